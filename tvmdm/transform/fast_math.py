"""FastMathTransform that works on modules with composite functions (a TVM 0.27 bug, regression test in
tests/transform/test_fast_math.py), with softmax normalized by a multiply by its row's reciprocal.

TVM's fast_softmax divides every exponential by its row's sum, a vector division per vector of the row (vdivps:
16-18 cycles a zmm on the CPUs we meet). Written ``exp * (1 / sum)``, the division no longer depends on the
position in the row and LLVM computes it once a row, outside the loop over the keys. The product differs from
the quotient by at most an ulp (onnxruntime's softmax multiplies by the reciprocal too). SM of BERT-base at
(8, 128) on 2 Sapphire Rapids cores, the Zen 4 kind's code: 1.19 against 1.30 ms."""
from __future__ import annotations

NORM_BLOCK = "T_softmax_norm"  # topi's name for softmax's last block, which the schedules know it by


def softmax_by_reciprocal(x, axis: int):
    """topi.nn.fast_softmax(x, axis) with its last block (same name) a multiply by the row's reciprocal."""
    from tvm import te, topi

    quotient = topi.nn.fast_softmax(x, axis)
    exp, total = sorted(quotient.op.input_tensors, key=lambda t: -len(t.shape))  # [.., S, ..], then [..]
    axis = axis % len(x.shape)

    def norm(*index):
        row = index[:axis] + index[axis + 1:]
        return exp(*index) * (te.const(1.0, x.dtype) / total(*row))

    return te.compute(x.shape, norm, name=NORM_BLOCK, attrs={"axis": axis})


def fast_math():
    """relax.transform.FastMathTransform (softmax, exp, erf, tanh -> TVM's polynomial versions) reads
    ``call.op.name`` of every call and raises AttributeError on calls of a GlobalVar, which every module has
    once FuseOpsByPattern made its composite functions. Same rewrite, skipping calls that are not of an Op;
    softmax as softmax_by_reciprocal."""
    import tvm
    from tvm import relax
    from tvm.relax.transform.fast_math import FastMathCodeGenerator

    from tvmdm.transform.ir import mutator_pass

    @relax.expr_functor.mutator
    class OpCallsOnly(FastMathCodeGenerator._cls):
        def visit_call_(self, call):
            if not isinstance(call.op, tvm.ir.Op):
                return relax.PyExprMutator.visit_call_(self, call)
            if call.op.name == "relax.nn.softmax":
                return self.builder_.call_te(softmax_by_reciprocal, self.visit_expr(call.args[0]),
                                             int(call.attrs.axis), primfunc_name_hint="fast_softmax")
            return super().visit_call_(call)

    return mutator_pass("tvmdm.FastMath", OpCallsOnly)
