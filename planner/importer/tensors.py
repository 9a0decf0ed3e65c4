"""What the import stages share about ONNX tensors: numpy names of the element types and
whether a tensor's data is in the proto."""

from __future__ import annotations

import math

import onnx

ONNX_TO_NUMPY: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.UINT32: "uint32", onnx.TensorProto.UINT64: "uint64",
    onnx.TensorProto.BOOL: "bool",
}

#: The fields a TensorProto may hold its inline data in.
DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
               "uint64_data", "string_data")


def has_inline_data(tensor: onnx.TensorProto) -> bool:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return False
    numel = math.prod(tensor.dims)  # exact: int64 products of corrupt dims wrap around
    return numel == 0 or any(getattr(tensor, name) for name in DATA_FIELDS)
