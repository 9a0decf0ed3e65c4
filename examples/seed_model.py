"""Write the seed tutorial's semi-auto network as ONNX: x[batch,128] @ w1[128,128] -> ReLU
-> @ w2[128,64], ops named matmul1, relu, matmul2 (so strategies can name them).

Run: python examples/seed_model.py seed.onnx
Then: shardplan plan seed.onnx --devices 2 --batch 32 --mode semi --strategies s.json
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 128])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w1 = numpy_helper.from_array(rng.standard_normal((128, 128)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((128, 64)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="matmul1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="matmul2")]
    graph = helper.make_graph(nodes, "seed", [x], [y], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "seed.onnx"
    onnx.save(build(), target)
    print(f"wrote {target}")
