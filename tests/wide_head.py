"""The per-stage mesh tests' model: a LLaMA whose head (a 256k vocabulary) outweighs each
of its 8 small layers (hidden 1024), planned on 8 A100s under a 5 GiB limit."""

from __future__ import annotations

from pathlib import Path

import onnx

from planner.zoo import build

SETTINGS = dict(profile="a100-80g", devices=8, batch=32, dims={"seq": 2048},
                memory_limit_gib=5.0)


def save_wide_head(folder: Path) -> Path:
    """The model saved in `folder`."""
    path = folder / "llama_wide_head.onnx"
    onnx.save(build("llama", layers=8, hidden=1024, heads=16, vocab=256000,
                    max_positions=2048), path)
    return path
