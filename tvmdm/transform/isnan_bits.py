"""isnan_as_bits: relax isnan(x) -> a TE kernel testing x's bits, which TVM vectorizes.

TVM's VectorizeLoop scalarizes any loop whose body calls tirx.isnan (topi.isnan's expression). torch's dynamo
exporter writes scaled_dot_product_attention's probabilities as where(isnan(P), 0, P), so the normalization of
SM's rows (the block that reads the softmax's sum and writes P) became 16 scalar multiplies, compares and
branches a vector: 15 % of the merged attention kernel's samples (perf, BERT-base's dynamo export at (8, 128),
2 Sapphire Rapids cores). The usual rewrites do not serve: TVM's simplifier folds x == x to true, and its float
!= is LLVM's ordered compare (NaN != NaN is false there).

A float is NaN exactly when its exponent bits are all ones and its mantissa is not 0: with the sign bit
cleared, its bits read as an integer exceed those of infinity (0x7F800000 for float32). The integer ops
vectorize, and the test is exact for every input.

Preconditions: before LegalizeOps and after the pattern fusion (its SM pattern and tile_attention read
relax.isnan). Rewrites every Relax function of the module; float16, float32 and float64 operands (others keep
isnan). The kernel keeps topi.isnan's name and tag, so fusion and the schedules see the same element-wise op.
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.transform.ir import call_op, mutator_pass

# float dtype -> (integer of its width, its bits without the sign, infinity's bits)
LAYOUTS = {
    "float16": ("int16", 0x7FFF, 0x7C00),
    "float32": ("int32", 0x7FFFFFFF, 0x7F800000),
    "float64": ("int64", 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


def nan_test(value, dtype: str):
    """The integer test equal to isnan(value), a TIR expression of ``dtype`` (one of LAYOUTS)."""
    from tvm import tirx

    bits, magnitude, infinity = LAYOUTS[dtype]
    return tirx.reinterpret(bits, value) & tirx.const(magnitude, bits) > tirx.const(infinity, bits)


def isnan_by_bits(x):
    """te: isnan(x) by nan_test, named and tagged as topi.isnan."""
    from tvm import te

    return te.compute(x.shape, lambda *index: nan_test(x(*index), str(x.dtype)), name="compute", tag="elemwise")


def isnan_as_bits() -> tvm.transform.Pass:
    """Every relax.isnan of a float16/32/64 tensor -> isnan_by_bits (see the module doc)."""

    @relax.expr_functor.mutator
    class ByBits(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call_op(call) == "relax.isnan" and str(call.args[0].ty.dtype) in LAYOUTS:
                return self.builder_.call_te(isnan_by_bits, call.args[0], primfunc_name_hint="isnan")
            return call

    return mutator_pass("tvmdm.IsnanAsBits", ByBits)
