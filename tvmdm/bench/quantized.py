"""int8 in the benchmark: what a user who quantized runs, on the same file.

``--precision int8`` quantizes the model as onnxruntime users do (``quantize_dynamic``, QInt8 weights; a file
that is already quantized is taken as it is) and adds three systems: tvmdm and onnxruntime on that int8 file,
and PyTorch's dynamic quantization of the embedded model's HF twin (tvmdm.models.torch_reference, precision
"int8": every nn.Linear on int8 weights, fbgemm / oneDNN kernels). Quantized systems are held to
tvmdm.core.precision.INT8_MAX_REL_ERR of the fp32 reference; when the benchmarked file is itself quantized,
every system to INT8_SAME_FILE_REL_ERR of onnxruntime on it.
"""
from __future__ import annotations

import os
import tempfile

from tvmdm.core.errors import TvmdmError

# ops that make a file quantized (dynamic, QDQ and QOperator formats)
QUANTIZED_OPS = {"DynamicQuantizeLinear", "MatMulInteger", "QuantizeLinear", "DequantizeLinear", "QLinearMatMul",
                 "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}


def is_quantized(proto) -> bool:
    return any(node.op_type in QUANTIZED_OPS for node in proto.graph.node)


def quantize_dynamic(proto):
    """``proto`` through onnxruntime's quantize_dynamic (QInt8 weights), as a ModelProto; a quantized ``proto``
    as it is."""
    import logging

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic as ort_quantize_dynamic

    if is_quantized(proto):
        return proto
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))  # its "run pre-processing" hint
    with tempfile.TemporaryDirectory(prefix="tvmdm-int8-") as tmp:
        source, target = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "int8.onnx")
        onnx.save(proto, source)
        ort_quantize_dynamic(source, target, weight_type=QuantType.QInt8)
        return onnx.load(target)


def refuse_int8_training(precisions) -> None:
    if "int8" in precisions:
        raise TvmdmError("--precision int8 is for inference (a quantized file has no training step); "
                         "use fp32 or bf16 with --train")
