"""Every op rule against ONNX's own node tests: the table of docs/op-coverage.md.

    python bench/op_coverage.py --write docs/op-coverage.md [--meshes 2,2x2,3,3x2]
        [--ops MatMul,Gemm] [--limit-strategies N]

For every single-op ONNX node test whose op has a labelling in the op registry, every
candidate split strategy on each mesh runs on virtual devices and is compared with ONNX's
expected outputs (the harness is `tests/nodetests.py`, which the tests also use).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nodetests import main

if __name__ == "__main__":
    raise SystemExit(main())
