"""divide_by_reciprocal: x / c, with c a float scalar constant and the quotient read only by a function that
fast_math approximates (erf, tanh, exp) -> x * (1 / c).

A division is a vector division per vector of x (vdivps: about 10 cycles a zmm on Sapphire Rapids, 5 on
Zen 4), where a multiply takes half a cycle. BERT's GELU, as every exporter writes it
(x * 0.5 * (1 + erf(x / 1.4142135))), divides each value of FFN1's output by sqrt(2) in the contraction's
epilogue; LLVM keeps the division (it may not use the reciprocal without fast-math flags, which TVM does not
set). onnxruntime's fused Gelu multiplies by 1/sqrt(2) as well.

The product x * RN(1/c) is within an ulp of RN(x / c). Where an approximation reads it, fast_erf's own error
(4.2e-7 absolute) is larger than that ulp's effect. Other quotients are left exact: DynamicQuantizeLinear's
scale, (max - min) / 255, must be onnxruntime's to the bit, or the activations quantize differently.

Only in quantized modules (``quantized_only``, the default: int8_contractions made int8_gemm kernels), whose
FFN1 kernel is ours. An fp32 module's FFN1 kernel is what the shipped tuning records were tuned on, and with
the multiply it no longer found its record: on the Zen 4 kind, BERT-base's layer kept 4 tuned kernels of 5
(tests/e2e/test_wheel.py); its fp32 time had not moved here (1.007x, noise).

Preconditions: before fast_math (which replaces erf, tanh and exp by PrimFunc calls) and LegalizeOps. Rewrites
every Relax function of the module (composite functions and a training module's functions too); divisors that
are not float scalar constants (one element), or are 0 or not finite, are left as they are, as are integer
divisions.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from tvmdm.transform.int8_kernels import INT8_GEMM_BLOCK
from tvmdm.transform.ir import (bindings_of, call_op, has_block, mutator_pass, readers_of, scalar_constant,
                               users_of)

FLOAT_DTYPES = ("float16", "float32", "float64")
APPROXIMATED = ("relax.erf", "relax.tanh", "relax.exp")  # what fast_math swaps for TVM's polynomials


def reciprocal_of(divisor) -> relax.Constant | None:
    """relax.const(1 / c) in c's dtype when ``divisor`` is a float constant of one element c, finite and not
    0; else None."""
    value = scalar_constant(divisor)
    if value is None or str(value.dtype) not in FLOAT_DTYPES or not np.isfinite(value) or value == 0:
        return None
    shape = tuple(divisor.value.shape)  # the divisor's shape, which broadcasts the same
    return relax.const((np.ones_like(value) / value).reshape(shape))  # IEEE division in c's dtype: RN(1/c)


def _approximated_quotients(func: relax.Function) -> set:
    """The divide calls of ``func`` by a constant whose quotient only APPROXIMATED functions read."""
    values, readers, users = bindings_of(func), readers_of(func), users_of(func)
    return {value for var, value in values.items()
            if call_op(value) == "relax.divide" and reciprocal_of(value.args[1]) is not None
            and readers.get(var) and len(readers[var]) == users.get(var)
            and all(call_op(values[reader]) in APPROXIMATED for reader in readers[var])}


def _quantized(mod: tvm.IRModule) -> bool:
    return any(isinstance(f, tirx.PrimFunc) and has_block(f, INT8_GEMM_BLOCK) for _, f in mod.functions_items())


def divide_by_reciprocal(quantized_only: bool = True) -> tvm.transform.Pass:
    """Those divisions by a float scalar constant that only erf, tanh or exp read -> multiplies by the
    constant's reciprocal, in quantized modules (``quantized_only``) or every module (see the module doc)."""

    @relax.expr_functor.mutator
    class ByReciprocal(relax.PyExprMutator):
        def __init__(self, mod, targets: set):
            super().__init__(mod)
            self.targets = targets

        def visit_call_(self, call):
            if call not in self.targets:
                return super().visit_call_(call)
            return relax.op.multiply(self.visit_expr(call.args[0]), reciprocal_of(call.args[1]))

    def make(mod):
        functions = [f for _, f in mod.functions_items() if isinstance(f, relax.Function)]
        targets = set().union(*(_approximated_quotients(f) for f in functions)) \
            if _quantized(mod) or not quantized_only else set()
        return ByReciprocal(mod, targets)

    return mutator_pass("tvmdm.DivideByReciprocal", make)
