"""Builders for tests/test_module_grouped.py: the examples' grouped-query LLaMA with
dropout on its attention probabilities."""

from __future__ import annotations

import torch
import transformers

from examples.hf_models import VOCAB, Example, LogitsOnly, next_token_loss, token_batch


def llama_attention_dropout() -> Example:
    """`examples.hf_models.llama` (4 query heads, 2 key/value heads) with attention
    dropout 0.1."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attention_dropout=0.1)
    return LogitsOnly(transformers.LlamaForCausalLM(config)), token_batch, next_token_loss
