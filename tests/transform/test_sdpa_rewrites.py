"""The paper level's rewrites for torch's scaled_dot_product_attention exports, each as a Relax pass on its own,
and the training step's removal of an export's Dropout nodes."""
import numpy as np
import pytest
import tvm
from tvm import relax

from tvmdm.train.dropout import strip_exported_dropout
from tvmdm.transform.ir import bindings_of, call_op
from tvmdm.transform.graph_rewrites import drop_noop_reshapes, hoist_operand_scales


def _module(body, *shapes):
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(list(s), "float32")) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, *arrays):
    vm = relax.VirtualMachine(relax.build(relax.transform.LegalizeOps()(mod), target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def _ops(mod) -> list:
    return [call_op(v) for v in bindings_of(mod["main"]).values()]


def _scores(bb, q, k, kscale=0.25):
    a = bb.emit(relax.op.multiply(q, relax.const(0.5, "float32")))
    b = bb.emit(relax.op.multiply(relax.const(kscale, "float32"), k))  # either operand order
    return relax.op.matmul(a, b)


def test_hoist_operand_scales_puts_one_scale_on_the_contraction():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 2, 4, 8)).astype("float32"), rng.standard_normal((1, 2, 8, 4)).astype("float32")
    mod = _module(_scores, q.shape, k.shape)
    hoisted = hoist_operand_scales()(mod)
    assert _ops(mod) == ["relax.multiply", "relax.multiply", "relax.matmul"]
    assert _ops(hoisted) == ["relax.matmul", "relax.multiply"]
    np.testing.assert_allclose(_run(hoisted, q, k), _run(mod, q, k), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_run(hoisted, q, k), 0.125 * (q @ k), rtol=1e-5, atol=1e-6)


def test_hoist_operand_scales_leaves_a_scaled_operand_read_elsewhere():
    def body(bb, q, k):
        a = bb.emit(relax.op.multiply(q, relax.const(0.5, "float32")))
        b = bb.emit(relax.op.multiply(k, relax.const(0.25, "float32")))
        return relax.op.add(bb.emit(relax.op.matmul(a, b)), relax.op.sum(a))  # a is read twice

    mod = _module(body, (1, 2, 4, 8), (1, 2, 8, 4))
    assert _ops(hoist_operand_scales()(mod)) == _ops(mod)


def test_drop_noop_reshapes_keeps_real_ones():
    def body(bb, x):
        same = bb.emit(relax.op.reshape(x, (2, 3, 4)))
        return relax.op.reshape(same, (6, 4))

    x = np.arange(24, dtype="float32").reshape(2, 3, 4)
    mod = _module(body, x.shape)
    dropped = drop_noop_reshapes()(mod)
    assert _ops(dropped) == ["relax.reshape"]
    np.testing.assert_array_equal(_run(dropped, x), x.reshape(6, 4))


def test_strip_exported_dropout_makes_it_the_identity():
    def body(bb, x):
        out = bb.emit(relax.op.nn.dropout(x, rate=0.1))
        return relax.op.sum(relax.op.multiply(bb.emit(relax.TupleGetItem(out, 0)), x))

    x = np.random.default_rng(1).standard_normal((2, 5)).astype("float32")
    mod = _module(body, x.shape)
    stripped = strip_exported_dropout()(mod)
    assert "relax.nn.dropout" in _ops(mod) and "relax.nn.dropout" not in _ops(stripped)
    np.testing.assert_allclose(_run(stripped, x), np.sum(x * x), rtol=1e-6)
    with pytest.raises(Exception, match="FPrimalGradient has not been registered for relax.nn.dropout"):
        relax.transform.Gradient("main")(mod)
    grad = relax.transform.LegalizeOps()(relax.transform.Gradient("main")(stripped))  # differentiable now
    vm = relax.VirtualMachine(relax.build(grad, target="llvm"), tvm.cpu())
    _, (dx,) = vm["main_adjoint"](tvm.runtime.tensor(x))
    np.testing.assert_allclose(dx.numpy(), 2 * x, rtol=1e-6)
