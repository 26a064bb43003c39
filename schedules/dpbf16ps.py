"""The AVX512-BF16 dot product as an LLVM function the bf16 kernels link in (see below for why)."""
# --- the AVX512-BF16 dot product -------------------------------------------------------------------------
# TVM 0.27's LLVM backend cannot emit vdpbf16ps from TIR: its bf16 legalization rewrites every bfloat16 vector
# into fp32 (and skipping it crashes the code generator on bfloat16 buffers), and LLVM 22's intrinsic only takes
# <32 x bfloat> operands, which call_llvm_pure_intrin on integer vectors does not bitcast to (the LLVM verifier
# rejects the call). So the kernels call this LLVM function on int32 vectors holding the bf16 pairs; it is linked
# into the module through the ``pragma_import_llvm`` loop annotation and inlined (alwaysinline).
DPBF16PS_FUNCTION = "tvmdm_dpbf16ps"


def llvm_dot_function(name: str, intrinsic: str, acc: str, operand: str, features: str) -> str:
    """An LLVM function ``name``(acc, a, b) on <16 x i32> operands, bitcast to the ``operand`` vectors the x86
    ``intrinsic`` takes, for TIR to call (call_pure_extern) where call_llvm_pure_intrin cannot reach it."""
    return f"""
define internal {acc} @{name}({acc} %acc, <16 x i32> %a, <16 x i32> %b) #0 {{
  %ab = bitcast <16 x i32> %a to {operand}
  %bb = bitcast <16 x i32> %b to {operand}
  %r = call {acc} @{intrinsic}({acc} %acc, {operand} %ab, {operand} %bb)
  ret {acc} %r
}}
declare {acc} @{intrinsic}({acc}, {operand}, {operand})
attributes #0 = {{ alwaysinline nounwind "target-features"="{features}" }}
"""


DPBF16PS_LLVM = llvm_dot_function(DPBF16PS_FUNCTION, "llvm.x86.avx512bf16.dpbf16ps.512", "<16 x float>",
                                  "<32 x bfloat>", "+avx512f,+avx512bf16")
