"""FastMathTransform that works on modules with composite functions (a TVM 0.27 bug, regression test in
tests/transform/test_fast_math.py)."""
from __future__ import annotations


def fast_math():
    """relax.transform.FastMathTransform (softmax, exp, erf, tanh -> TVM's polynomial versions) reads
    ``call.op.name`` of every call and raises AttributeError on calls of a GlobalVar, which every module has
    once FuseOpsByPattern made its composite functions. Same rewrite, skipping calls that are not of an Op."""
    import tvm
    from tvm import relax
    from tvm.relax.transform.fast_math import FastMathCodeGenerator

    @relax.expr_functor.mutator
    class OpCallsOnly(FastMathCodeGenerator._cls):
        def visit_call_(self, call):
            if not isinstance(call.op, tvm.ir.Op):
                return relax.PyExprMutator.visit_call_(self, call)
            return super().visit_call_(call)

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.FastMath")
    def transform(mod, _ctx):
        rewriter = OpCallsOnly(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()

    return transform
