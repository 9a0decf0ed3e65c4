"""Export tiny real models to ONNX with both torch exporters, for tests and notebooks.

The planner must cope with what PyTorch really emits, so tests read graphs exported here
from GPT-2, BERT, LLaMA (transformers, random weights, no hub) and a torchvision-style
ResNet, rather than hand-built graphs. Each export is cached by file name (the name
encodes every option), so a test session pays for each variant once.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import math
import os
import pathlib
import shutil
import tempfile
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

MODELS = ("gpt2", "bert", "llama", "resnet")
#: More families users export (issue 16): GQA decoders, parallel-residual, encoder-decoder,
#: a vision transformer and a top-2 MoE. Kept apart from MODELS, whose every variant the
#: export study and its tests sweep.
FAMILIES = ("mistral", "qwen2", "gpt_neox", "opt", "t5", "vit", "mixtral")
ALL_MODELS = MODELS + FAMILIES
IMAGE_MODELS = ("resnet", "vit")
EXPORTERS = ("torchscript", "dynamo")

#: Highest opset each exporter accepts in torch 2.13 (the TorchScript exporter stops at 20).
MAX_OPSET = {"torchscript": 20, "dynamo": 23}

VOCAB = 1000
HIDDEN = 64
HEADS = 4
LAYERS = 2
MAX_POSITIONS = 128
IMAGE = 32
NUM_CLASSES = 10
SEED = 0


@dataclass(frozen=True)
class Size:
    """Widths of a token model; the default is the tiny size tests export with real weights
    (bench/real_exports.py plans wider ones exported without weight memory)."""

    hidden: int = HIDDEN
    heads: int = HEADS
    ffn: int = 172  # LLaMA-style SwiGLU width; 4 * hidden for GELU MLPs
    vocab: int = VOCAB
    positions: int = MAX_POSITIONS

    @classmethod
    def of_hidden(cls, hidden: int, vocab: int = 32000, positions: int = 4096) -> Size:
        """A realistic shape: 64-wide heads, LLaMA's 8/3 * hidden FFN rounded to 256."""
        return cls(hidden, max(1, hidden // 64), -(-hidden * 8 // 3 // 256) * 256, vocab,
                   positions)


TINY = Size()


@dataclass
class Example:
    """A model ready to export plus the inputs to trace it with.

    `dynamic_dims` maps each input name to the axes that become symbolic (axis -> name).
    Inputs are passed as keyword arguments, in `inputs` order.
    """

    module: nn.Module
    inputs: dict[str, torch.Tensor]
    output_names: list[str]
    dynamic_dims: dict[str, dict[int, str]] = field(default_factory=dict)


# --------------------------------------------------------------------------- models


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 conv+BN, identity or 1x1-conv shortcut."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A two-stage torchvision-style ResNet for 32x32 images (torchvision is not installed).

    Module names follow torchvision (conv1, bn1, layer1.0.conv1, fc, ...) so initializer
    names look like a real ResNet export.
    """

    def __init__(self, widths: tuple[int, ...] = (16, 32), blocks: int = 2,
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = widths[0]
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(*(
                BasicBlock(inplanes if b == 0 else width, width, stride if b == 0 else 1)
                for b in range(blocks)
            ))
            self.add_module(f"layer{i + 1}", layer)
            inplanes = width
        self.num_layers = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        for i in range(self.num_layers):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _build_module(model: str, layers: int = LAYERS, size: Size = TINY) -> nn.Module:
    """Build the tiny model with default (not yet randomised) weights."""
    if model == "resnet":
        return ResNet()
    import transformers  # slow import: only for the token models

    family = _build_family(transformers, model, layers, size)
    if family is not None:
        return family

    if model == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=size.vocab, n_positions=size.positions, n_embd=size.hidden,
            n_layer=layers, n_head=size.heads, use_cache=False, bos_token_id=0, eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(cfg)
    if model == "bert":
        cfg = transformers.BertConfig(
            vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=layers,
            num_attention_heads=size.heads, intermediate_size=4 * size.hidden,
            max_position_embeddings=size.positions,
        )
        return transformers.BertForMaskedLM(cfg)
    if model == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.ffn,
            num_hidden_layers=layers, num_attention_heads=size.heads,
            num_key_value_heads=size.heads, max_position_embeddings=size.positions,
            use_cache=False,
        )
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {model!r}; choose one of {ALL_MODELS}")


def _build_family(transformers: types.ModuleType, model: str, layers: int,
                  size: Size) -> nn.Module | None:
    """The FAMILIES models (None for any other name)."""
    kv_heads = max(1, size.heads // 2)
    decoder = dict(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=layers,
                   num_attention_heads=size.heads, max_position_embeddings=size.positions,
                   use_cache=False)
    if model == "mistral":  # grouped-query attention, 2 KV heads
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            **decoder, intermediate_size=size.ffn, num_key_value_heads=kv_heads,
            sliding_window=None))
    if model == "qwen2":  # GQA with biased q/k/v projections
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **decoder, intermediate_size=size.ffn, num_key_value_heads=kv_heads))
    if model == "gpt_neox":  # fused QKV, partial rotary, parallel residual
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            **decoder, intermediate_size=4 * size.hidden, rotary_pct=0.25))
    if model == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=layers,
            num_attention_heads=size.heads, ffn_dim=4 * size.hidden,
            word_embed_proj_dim=size.hidden, max_position_embeddings=size.positions,
            use_cache=False))
    if model == "t5":  # encoder and decoder stacks, relative position bias
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=size.vocab, d_model=size.hidden, d_kv=size.hidden // size.heads,
            d_ff=4 * size.hidden, num_layers=layers, num_decoder_layers=layers,
            num_heads=size.heads, use_cache=False,
            decoder_start_token_id=0))
    if model == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=size.hidden, num_hidden_layers=layers, num_attention_heads=size.heads,
            intermediate_size=4 * size.hidden, image_size=IMAGE, patch_size=4,
            num_labels=NUM_CLASSES))
    if model == "mixtral":  # top-2 of 4 experts
        # "eager" experts route through NonZero/index_add, which TorchScript exports (the
        # default grouped_mm uses histc, which neither exporter takes; dynamo exports only
        # "batched_mm", a gather of every token's expert weights)
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **decoder, intermediate_size=size.ffn, num_key_value_heads=kv_heads,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            experts_implementation="eager"))
    return None


def _randomise(module: nn.Module, generator: torch.Generator) -> None:
    """Give every parameter and float buffer distinct random values.

    Exporters merge initializers with equal contents (e.g. all-zero biases), which would
    hide module names from the planner; norm scales stay near 1 and BatchNorm variances
    stay positive so activations remain well-conditioned for the 1e-4 comparison.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            elif name.endswith("weight"):  # norm scales
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
        for name, b in module.named_buffers():
            if not b.is_floating_point():
                continue
            if name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=generator) + 0.5)
            elif name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=generator))


def _logits_only(module: nn.Module, model: str = "") -> None:
    """Make `module` take (input_ids, attention_mask) and return the logits tensor.

    Bound on the instance, not via a wrapper module, so parameter names keep the
    transformers spelling (no `model.` prefix). Without it the TorchScript exporter fills
    in every later forward default and turns `logits_to_keep` into a graph input.
    """
    cls_forward = type(module).forward
    if model == "vit":
        def image_forward(self: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
            return cls_forward(self, pixel_values=pixel_values).logits

        module.forward = types.MethodType(image_forward, module)  # type: ignore[method-assign]
        return
    if model == "t5":  # the decoder reads the same ids (teacher forcing, shifted or not)
        def seq2seq_forward(self: nn.Module, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor) -> torch.Tensor:
            return cls_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                               decoder_input_ids=input_ids).logits

        module.forward = types.MethodType(seq2seq_forward, module)  # type: ignore[method-assign]
        return

    def forward(self: nn.Module, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        return cls_forward(self, input_ids=input_ids, attention_mask=attention_mask).logits

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


def build(model: str, *, training: bool = False, batch: int = 2, seq: int = 16,
          layers: int = LAYERS) -> Example:
    """Build a seeded, randomised tiny `model` in eval or train mode with example inputs."""
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    module = _build_module(model, layers)
    _randomise(module, generator)
    module.train(training)
    if model in IMAGE_MODELS:
        if model != "resnet":
            _logits_only(module, model)
        image = torch.randn(batch, 3, IMAGE, IMAGE, generator=generator)
        return Example(module, {"pixel_values": image}, ["logits"],
                       {"pixel_values": {0: "batch"}})
    _logits_only(module, model)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    # GPT-2's TorchScript export needs an explicit mask (else aten::diff); pass one to all.
    mask = torch.ones(batch, seq, dtype=torch.int64)
    token_axes = {0: "batch", 1: "seq"}
    return Example(module, {"input_ids": ids, "attention_mask": mask}, ["logits"],
                   {"input_ids": token_axes, "attention_mask": token_axes})


def random_inputs(model: str, batch: int, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """Fresh inputs of a given batch/seq, e.g. to prove that exported axes are dynamic.

    The last sequence is right-padded (its last quarter masked out) so a comparison with
    torch also proves the exported graph really applies the attention mask.
    """
    generator = torch.Generator().manual_seed(seed)
    if model in IMAGE_MODELS:
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=generator)}
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq - seq // 4:] = 0
    return {
        "input_ids": torch.randint(0, VOCAB, (batch, seq), generator=generator),
        "attention_mask": mask,
    }


# --------------------------------------------------------------------------- export


class ExportModel(Protocol):
    """Signature of conftest's `export_model` fixture: `export` with the cache dir bound."""

    def __call__(self, model: str, exporter: str = "torchscript", *, training: bool = False,
                 opset: int = 17, dynamic: bool = True, batch: int = 2,
                 seq: int = 16, layers: int = LAYERS) -> pathlib.Path: ...


def file_name(model: str, exporter: str, *, training: bool, opset: int, dynamic: bool,
              batch: int, seq: int, layers: int = LAYERS) -> str:
    """The cache key: every option that changes the exported graph is in the name."""
    mode = "train" if training else "eval"
    shape = "dyn" if dynamic else "static"
    dims = f"b{batch}" if model in IMAGE_MODELS else f"b{batch}s{seq}"
    depth = "" if layers == LAYERS else f"-l{layers}"
    return f"{model}-{exporter}-{mode}-op{opset}-{shape}-{dims}{depth}.onnx"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence exporter prints, warnings and log records; they drown pytest output."""
    names = ("torch", "torch.onnx", "torch.export", "torch._dynamo", "torch.__trace",
             "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    sink = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
                contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _export_torchscript(ex: Example, path: pathlib.Path, *, training: bool, opset: int,
                        dynamic: bool) -> None:
    """Legacy exporter: train mode needs TRAINING plus no folding to keep Dropout/BN and names."""
    names = list(ex.inputs)
    dynamic_axes: dict[str, dict[int, str]] | None = None
    if dynamic:
        dynamic_axes = dict(ex.dynamic_dims)
        first = next(iter(ex.dynamic_dims.values()))
        for out in ex.output_names:  # logits share the leading (batch[, seq]) axes
            dynamic_axes[out] = dict(first)
    torch.onnx.export(
        ex.module, (), str(path), kwargs=dict(ex.inputs), dynamo=False,
        input_names=names, output_names=ex.output_names, opset_version=opset,
        dynamic_axes=dynamic_axes,
        training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL,
        do_constant_folding=not training,
    )


def _export_dynamo(ex: Example, path: pathlib.Path, *, training: bool, opset: int,
                   dynamic: bool) -> None:
    """torch.export-based exporter: the mode comes from `module.train()`, not `training=`."""
    dynamic_shapes: dict[str, dict[int, torch.export.Dim]] | None = None
    if dynamic:
        dims: dict[str, torch.export.Dim] = {}
        dynamic_shapes = {
            name: {axis: dims.setdefault(label, torch.export.Dim(label, min=2, max=1024))
                   for axis, label in axes.items()}
            for name, axes in ex.dynamic_dims.items()
        }
    torch.onnx.export(
        ex.module, (), str(path), kwargs=dict(ex.inputs), dynamo=True,
        input_names=list(ex.inputs), output_names=ex.output_names, opset_version=opset,
        dynamic_shapes=dynamic_shapes, external_data=False,
        # optimize=True folds BatchNorm into Conv even in train mode and renames weights;
        # off, train exports keep every BatchNormalization, Dropout and parameter name.
        optimize=not training,
    )


def export(model: str, exporter: str = "torchscript", *, training: bool = False,
           opset: int = 17, out_dir: pathlib.Path, dynamic: bool = True, batch: int = 2,
           seq: int = 16, layers: int = LAYERS) -> pathlib.Path:
    """Export `model` with `exporter` into `out_dir` and return the .onnx path.

    Returns the cached file if a previous call already wrote it. The file appears
    atomically (exported in a scratch directory, then renamed), so an interrupted or
    concurrent export never leaves a half-written model under the cache name. Weights
    are embedded, so the single file loads with `onnx.load`.

    Exporter quirks measured with torch 2.13 (docs/export-study.md): dynamo asked for
    opset 17 writes 18 for LLaMA/ResNet and an invalid opset-17 file for GPT-2; dynamo
    train mode exports BatchNorm with inference semantics.
    """
    if model not in ALL_MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {ALL_MODELS}")
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; choose one of {EXPORTERS}")
    if opset > MAX_OPSET[exporter]:
        raise ValueError(f"{exporter} exporter supports opset <= {MAX_OPSET[exporter]}")
    if exporter == "dynamo" and dynamic and min(batch, 2 if model in IMAGE_MODELS else seq) < 2:
        # torch.export specialises sizes 0 and 1, so a size-1 example cannot stay symbolic.
        raise ValueError("dynamic dynamo export needs example batch and seq >= 2")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / file_name(model, exporter, training=training, opset=opset,
                                 dynamic=dynamic, batch=batch, seq=seq, layers=layers)
    if target.exists():
        return target
    # One exporter per file at a time: a second process (an xdist worker) waits for the
    # first one's file instead of exporting the same model again. The lock file goes once
    # the model is in place: whoever locks it (or a new one) after that finds the model.
    lock_path = out_dir / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not target.exists():
                _export_into(target, model, exporter, training=training, opset=opset,
                             dynamic=dynamic, batch=batch, seq=seq, layers=layers)
        finally:
            lock_path.unlink(missing_ok=True)
    return target


def _export_into(target: pathlib.Path, model: str, exporter: str, *, training: bool,
                 opset: int, dynamic: bool, batch: int, seq: int, layers: int) -> None:
    """Export into a scratch folder beside `target`, then rename: the file appears whole."""
    ex = build(model, training=training, batch=batch, seq=seq, layers=layers)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=".export-", dir=target.parent))
    try:
        tmp = scratch / target.name
        fn = _export_torchscript if exporter == "torchscript" else _export_dynamo
        with _quiet(), torch.random.fork_rng():
            fn(ex, tmp, training=training, opset=opset, dynamic=dynamic)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------- shapes only

#: initializers above this many elements are written as external data that is never
#: written (the planner reads dims and dtypes only); smaller ones (shape constants,
#: inv_freq) keep their values, which folding reads
SHAPE_ONLY_INLINE_ELEMENTS = 1 << 16
ABSENT_WEIGHTS = "weights-not-written.bin"


def export_shapes_only(model: str, exporter: str, path: pathlib.Path, *, layers: int,
                       size: Size, opset: int = 18) -> pathlib.Path:
    """Export `model` at any `size` in eval mode without the memory of its weights.

    Built on the meta device, every parameter becomes a stride-0 view of one number (its
    own, so no two are merged as equal) and every buffer zeros, so a 7B-parameter LLaMA
    exports in a minute; the file lists each large initializer's dims and dtype with
    external data that does not exist. Planning needs nothing more; running does (use
    `export` for that)."""
    if model in IMAGE_MODELS:
        raise ValueError("shape-only exports are for token models")
    with torch.device("meta"):
        module = _build_module(model, layers, size)
    fills = iter(range(1, 1 << 30))  # distinct values: exporters merge equal initializers
    for owner in module.modules():
        for name, p in list(owner.named_parameters(recurse=False)):
            one = torch.full((1,), float(next(fills)), dtype=p.dtype)
            setattr(owner, name, nn.Parameter(one.expand(p.shape), requires_grad=p.requires_grad))
        for name, b in list(owner.named_buffers(recurse=False)):
            owner.register_buffer(name, torch.zeros(1, dtype=b.dtype).expand(b.shape).clone()
                                  if b.numel() <= SHAPE_ONLY_INLINE_ELEMENTS
                                  else torch.zeros(1, dtype=b.dtype).expand(b.shape))
    module.eval()
    _logits_only(module, model)
    ids = torch.zeros(2, 16, dtype=torch.int64)
    ex = Example(module, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ["logits"],
                 {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}})
    import onnx
    from onnx import numpy_helper

    path = pathlib.Path(path)
    with _quiet(), torch.no_grad():
        if exporter == "dynamo":
            dims: dict[str, torch.export.Dim] = {}
            program = torch.onnx.export(
                module, (), kwargs=dict(ex.inputs), dynamo=True, opset_version=opset,
                input_names=list(ex.inputs), output_names=ex.output_names,
                dynamic_shapes={name: {axis: dims.setdefault(label, torch.export.Dim(
                    label, min=2, max=size.positions)) for axis, label in axes.items()}
                    for name, axes in ex.dynamic_dims.items()})
            program.save(str(path), include_initializers=False)
            proto = onnx.load(str(path))
            arrays = {name: value.const_value for name, value in
                      program.model.graph.initializers.items()}
            specs = {name: (int(value.dtype), [int(d) for d in value.shape])
                     for name, value in program.model.graph.initializers.items()}
        else:
            _export_torchscript(ex, path, training=False, opset=opset, dynamic=True)
            proto = onnx.load(str(path))
            arrays = {init.name: init for init in proto.graph.initializer}
            specs = {init.name: (init.data_type, list(init.dims))
                     for init in proto.graph.initializer}
            del proto.graph.initializer[:]
    for name, (data_type, dims_of) in specs.items():
        if math.prod(dims_of) <= SHAPE_ONLY_INLINE_ELEMENTS:
            value = arrays[name]
            proto.graph.initializer.append(
                value if isinstance(value, onnx.TensorProto)
                else numpy_helper.from_array(np.asarray(value.numpy()), name))
            continue
        tensor = onnx.TensorProto(name=name, data_type=data_type, dims=dims_of,
                                  data_location=onnx.TensorProto.EXTERNAL)
        for key, text in (("location", ABSENT_WEIGHTS), ("offset", "0"), ("length", "0")):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, text
        proto.graph.initializer.append(tensor)
    onnx.save(proto, str(path))
    return path
