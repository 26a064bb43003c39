"""tvmdm.transform.fast_math: FastMathTransform on modules with composite functions."""
import numpy as np
import pytest

from tvmdm.transform.fast_math import fast_math


def test_fast_math_on_modules_with_composite_functions():
    """FastMathTransform reads call.op.name of every call and fails on calls of a GlobalVar (every module has
    them once FuseOpsByPattern made composite functions); tvmdm.transform.fast_math rewrites the same ops."""
    import tvm
    from tvm import relax
    from tvm.relax.dpl import is_op, wildcard

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, x))
            z = bb.emit(relax.op.nn.softmax(relax.op.erf(y), axis=-1))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    mod = relax.transform.FuseOpsByPattern([("add", is_op("relax.add")(wildcard(), wildcard()))],
                                           bind_constants=False, annotate_codegen=False)(bb.get())
    with pytest.raises(Exception, match="'GlobalVar' object has no attribute 'name'"):
        relax.transform.FastMathTransform()(mod)
    fast = fast_math()(mod)
    names = [gv.name_hint for gv in fast.get_global_vars()]
    assert "fast_softmax" in names and "fast_erf" in names
    built = relax.build(relax.transform.LegalizeOps()(fast), target="llvm")
    vm = relax.VirtualMachine(built, tvm.cpu())
    a = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    from math import erf

    ref = np.vectorize(erf)(2 * a.astype(np.float64))
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(a)).numpy(), ref, atol=1e-6)


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_normalizes_by_the_rows_reciprocal_within_an_ulp_of_the_quotient(axis):
    """The division by the row's sum does not depend on the position in the row, so the compiler takes it out
    of the loop over the row."""
    import tvm
    from tvm import te, topi
    from tvm.s_tir import Schedule

    from tvmdm.transform.fast_math import NORM_BLOCK, softmax_by_reciprocal

    x = te.placeholder((3, 40, 24), "float32", name="x")
    func = te.create_prim_func([x, softmax_by_reciprocal(x, axis)])
    sch = Schedule(func)
    norm = sch.get(sch.get_sblock(NORM_BLOCK))
    assert isinstance(norm.body.value, tvm.tirx.Mul) and isinstance(norm.body.value.b, tvm.tirx.Div)
    quotient = te.create_prim_func([x, topi.nn.fast_softmax(x, axis)])
    a = np.random.default_rng(3).standard_normal((3, 40, 24)).astype(np.float32) * 4

    def run(f):
        out = tvm.runtime.tensor(np.zeros_like(a))
        tvm.compile(f.with_attr("global_symbol", "main"), target="llvm")(tvm.runtime.tensor(a), out)
        return out.numpy()

    got = run(func)
    np.testing.assert_array_max_ulp(got, run(quotient), maxulp=2)
    np.testing.assert_allclose(got.sum(axis=axis), 1.0, rtol=1e-5)
