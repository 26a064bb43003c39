"""The AVX512-BF16 dot product as an LLVM function the bf16 kernels link in (see below for why)."""
# --- the AVX512-BF16 dot product -------------------------------------------------------------------------
# TVM 0.27's LLVM backend cannot emit vdpbf16ps from TIR: its bf16 legalization rewrites every bfloat16 vector
# into fp32 (and skipping it crashes the code generator on bfloat16 buffers), and LLVM 22's intrinsic only takes
# <32 x bfloat> operands, which call_llvm_pure_intrin on integer vectors does not bitcast to (the LLVM verifier
# rejects the call). So the kernels call this LLVM function on int32 vectors holding the bf16 pairs; it is linked
# into the module through the ``pragma_import_llvm`` loop annotation and inlined (alwaysinline).
DPBF16PS_FUNCTION = "tvmdm_dpbf16ps"
DPBF16PS_LLVM = r"""
define internal <16 x float> @tvmdm_dpbf16ps(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) #0 {
  %ab = bitcast <16 x i32> %a to <32 x bfloat>
  %bb = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %ab, <32 x bfloat> %bb)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
attributes #0 = { alwaysinline nounwind "target-features"="+avx512f,+avx512bf16" }
"""
