"""The precisions tvmdm compiles for, where each is built, and the accuracy each is held to."""
from __future__ import annotations

PRECISIONS = ("fp32", "bf16", "fp16")
# Which target kinds each reduced precision is built for (its kernels and schedules are target-specific).
PRECISION_TARGETS = {"bf16": ("llvm", "cuda"), "fp16": ("cuda",)}
# The documented accuracy of precision="bf16": max |out - out_fp32| / max |out_fp32| per output, vs onnxruntime
# fp32 (tests check it on tiny layers; bf16 keeps 8 bits of mantissa, a relative rounding of 2^-9 per operand).
BF16_MAX_REL_ERR = 1e-2
# precision="fp16" (CUDA): 11 bits of mantissa, a relative rounding of 2^-12 per operand, fp32 accumulation;
# the bound keeps bf16's margin over its rounding (2^-9 -> 1e-2).
FP16_MAX_REL_ERR = 2e-3
# int8 against fp32: quantize_dynamic's per-tensor activations lose ~2^-8 of each tensor's range per operand;
# measured on BERT-base widths (2 layers, (8, 128)): 1.4% of the hidden state's max, 4.4% of the pooler's.
INT8_MAX_REL_ERR = 1e-1
# two runtimes on the same int8 file: the same integers, up to where an fp32 rounding before a quantization
# flips one quantization step (BERT-base widths, 2 layers: 0.55% between onnxruntime with and without its
# BERT optimizer, and between tvmdm and onnxruntime)
INT8_SAME_FILE_REL_ERR = 2e-2
MAX_REL_ERR = {"bf16": BF16_MAX_REL_ERR, "fp16": FP16_MAX_REL_ERR, "tf32": FP16_MAX_REL_ERR,  # TF32: fp16's mantissa
               "int8": INT8_MAX_REL_ERR}  # the benchmark's quantized systems (tvmdm.bench.quantized)


def reduced_precision(system: str) -> str | None:
    """The reduced precision a benchmark system's name says it runs in ("tvmdm[fp16]", "torch-cuda[bf16]"), or
    None (fp32). Such systems are held to MAX_REL_ERR of theirs, the others to fp32 tolerances."""
    return next((p for p in MAX_REL_ERR if p in system), None)


def check_precision(precision: str, target_kind: str | None = None) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    kinds = PRECISION_TARGETS.get(precision)
    if kinds and target_kind is not None and target_kind not in kinds:
        other = {"llvm": "bf16"}.get(target_kind)
        raise ValueError(f"precision={precision!r} is built for {'/'.join(kinds)} targets, not {target_kind}"
                         + (f"; use precision={other!r} there" if other else ""))
    return precision
