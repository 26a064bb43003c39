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


# the int8 systems that run the quantized file itself, checked against onnxruntime's outputs on it
SAME_FILE_SYSTEMS = ("onnxruntime[int8]", "tvmdm[int8]")


def relative_error(outputs: list, reference: list) -> float:
    """max |out - ref| / max |ref|, the largest over the outputs (build.check.compare_outputs' max_rel_err)."""
    import numpy as np

    from tvmdm.build.check import compare_outputs

    names = [f"output_{i}" for i in range(len(reference))]
    check = compare_outputs(names, [np.asarray(o) for o in outputs], reference, atol=0.0, rtol=0.0)
    return max(o.max_rel_err for o in check.outputs)


def same_file_bound(proto, feeds: dict, output_names, threads: int, optimized: list) -> float:
    """How far two correct runtimes on the same int8 file may differ (max relative error): INT8_SAME_FILE_REL_ERR
    or twice what onnxruntime differs from itself with its graph optimizations on (``optimized``: its outputs,
    which the benchmark has already) and off, whichever is larger. A rounding before a quantization that flips
    one step propagates through every layer after it: on BERT-base (12 layers, a dynamo export, (8, 128))
    onnxruntime against itself was 3.3% of the hidden state's largest value off and 7.3% of the pooler's; with
    2 layers 0.55%."""
    from tvmdm.build.check import ort_session
    from tvmdm.core.precision import INT8_SAME_FILE_REL_ERR

    plain = ort_session(proto, threads, optimized=False).run(output_names, feeds)
    return max(INT8_SAME_FILE_REL_ERR, 2 * relative_error(plain, optimized))


def int8_checks(names, reference: list, int8_reference: list, same_file: float) -> tuple[dict, dict, float]:
    """How a benchmark that quantized an fp32 file checks its int8 systems (``names``: every system):
    tvmdm and onnxruntime on the int8 file against onnxruntime's outputs on it (``int8_reference``) within
    ``same_file`` (same_file_bound); PyTorch's own dynamic quantization against fp32 (``reference``) within
    INT8_MAX_REL_ERR or twice the file's own quantization error, whichever is larger (that error grows with
    depth: BERT-base's pooler output from onnxruntime on the int8 file is 17% of its largest value off fp32,
    4.4% with 2 layers). Returns (name -> relative bound, name -> (whose outputs, outputs) for run_jobs, the
    quantization's own error)."""
    from tvmdm.core.precision import INT8_MAX_REL_ERR

    error = relative_error(int8_reference, reference)
    relative, references = {}, {}
    for name in names:
        if name in SAME_FILE_SYSTEMS:
            relative[name] = same_file
            references[name] = ("onnxruntime[int8]", int8_reference)
        elif "int8" in name:
            relative[name] = max(INT8_MAX_REL_ERR, 2 * error)
    return relative, references, error
