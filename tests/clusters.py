"""What the mixed-cluster tests build: cluster files and the model they plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner import zoo


def cluster_file(folder: Path, groups: list[dict[str, Any]], **extra: Any) -> Path:
    data = {"schema": "shardplan.cluster/1", "name": "test", "groups": groups, **extra}
    path = folder / f"cluster-{len(list(folder.glob('cluster-*')))}.json"
    path.write_text(json.dumps(data))
    return path


def group(name: str, profile: str, devices: int) -> dict[str, Any]:
    return {"name": name, "profile": profile, "devices": devices}


def a100_h100_file(folder: Path) -> Path:
    """8 A100 and 8 H100."""
    return cluster_file(folder, [group("a100", "a100-80g", 8), group("h100", "h100-sxm", 8)])


def eight_layers(folder: Path) -> Path:
    """Eight layers wide enough that compute, not latency, sets a stage's time."""
    return zoo.save(zoo.build("gpt-tiny", layers=8, hidden=512, heads=8, vocab=1024),
                    folder / "gpt8.onnx")
