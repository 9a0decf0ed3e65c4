"""transformers models built from configs (random weights, no hub), in the form
`executor.parallelize` and `shardplan run --module` take: `FN()` returns
`(module, make_batch, loss_fn)`.

- `make_batch(step, batch_size)` gives the global batch of a step as keyword inputs of the
  module's forward, the same on every rank (each rank keeps its own shard of it);
- `loss_fn(output, batch)` is the scalar loss of the module's output on that batch.

Sizes are tiny so the examples and tests train on CPU ranks in seconds; scale the configs
up for real runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

Batch = dict[str, torch.Tensor]
Example = tuple[nn.Module, Callable[[int, int], Batch], Callable[[Any, Batch], torch.Tensor]]

VOCAB = 256
SEQUENCE = 16


class LogitsOnly(nn.Module):
    """A causal LM's forward with its logits as the only output (what a loss reads), under
    the wrapped model's own parameter names plus the prefix `model.`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def token_batch(step: int, batch_size: int) -> Batch:
    """Random token ids of one step, the same on every rank (seeded by the step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQUENCE), generator=generator)}


def next_token_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next token."""
    ids = batch["input_ids"]
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(0, 1))


def llama(layers: int = 2) -> Example:
    """A 2-layer LLaMA with grouped-query attention (4 query heads, 2 key/value heads)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False)
    return LogitsOnly(transformers.LlamaForCausalLM(config)), token_batch, next_token_loss


def llama_deep() -> Example:
    """The same LLaMA with 4 layers: enough for an interleaved pipeline of 2 stages × 2
    model chunks, a layer each."""
    return llama(layers=4)


def llama_medium() -> Example:
    """A 2-layer LLaMA of hidden 256 (8 query heads, 4 key/value heads) on 64-token rows:
    large enough that a step's kernels, not per-op overheads, are most of its time on one
    CPU core (`bench/fidelity.py --module`)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        use_cache=False)

    def batch(step: int, batch_size: int) -> Batch:
        generator = torch.Generator().manual_seed(1000 + step)
        return {"input_ids": torch.randint(0, 2048, (batch_size, 64), generator=generator)}

    return LogitsOnly(transformers.LlamaForCausalLM(config)), batch, next_token_loss


def _bf16_llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                seq: int) -> Example:
    """A transformers LLaMA in bf16 (weights and activations) on `seq`-token rows."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
        use_cache=False)
    model = LogitsOnly(transformers.LlamaForCausalLM(config)).to(torch.bfloat16)

    def batch(step: int, batch_size: int) -> Batch:
        generator = torch.Generator().manual_seed(1000 + step)
        return {"input_ids": torch.randint(0, vocab, (batch_size, seq), generator=generator)}

    return model, batch, next_token_loss


def llama_gpu() -> Example:
    """A bf16 LLaMA sized for one GPU (`bench/gpu_check.py`): 6 layers, hidden 2048, GQA
    16/4 heads, SwiGLU 5632, vocab 32000, 2048-token rows; 403 M parameters, so its export
    (weights inside the ONNX file) stays under protobuf's 2 GB and its GEMMs, not per-op
    overheads, are most of a step on the GPU."""
    return _bf16_llama(layers=6, hidden=2048, heads=16, kv_heads=4, ffn=5632, vocab=32000,
                       seq=2048)


def llama_gpu_tiny() -> Example:
    """`llama_gpu`'s shape at a size a CPU trains in seconds (tests of the GPU script)."""
    return _bf16_llama(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32)


def gpt2() -> Example:
    """A 2-layer GPT-2 (transformers' Conv1D projections; dropout 0.1 as GPT-2 trains)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2,
                                     n_head=4, use_cache=False)
    return LogitsOnly(transformers.GPT2LMHeadModel(config)), token_batch, next_token_loss


def bert() -> Example:
    """A 2-layer BERT masked LM (dropout 0.1), trained here to predict its own tokens."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=64)
    return LogitsOnly(transformers.BertForMaskedLM(config)), token_batch, next_token_loss


#: LLaMA's projections Megatron-LM splits by output (column) and by input (row).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def megatron_strategies(graph: Any, ways: int = 2) -> dict[str, list[list[int]]]:
    """MindSpore-style pins (`shardplan plan --mode semi --strategies`) for an exported
    LLaMA `PlanningGraph`: the MatMul of each column-parallel projection cuts its weight's
    output dim `ways` times, that of each row-parallel one its contraction dim; the
    search fills in the rest."""
    producer = {o: op for op in graph.ops for o in op.outputs}
    strategies = {}
    for op in graph.ops:
        if op.op_type != "MatMul":
            continue
        source = producer.get(op.inputs[1])
        weight = source.inputs[0] if source is not None and source.op_type == "Transpose" \
            else op.inputs[1]
        leaf = weight.split(".")[-2] if "." in weight else ""
        rank = len(graph.tensors[op.inputs[0]].shape)
        if leaf in COLUMN_PARALLEL:
            strategies[op.name] = [[1] * rank, [1, ways]]
        elif leaf in ROW_PARALLEL:
            strategies[op.name] = [[1] * (rank - 1) + [ways], [ways, 1]]
    return strategies
