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
