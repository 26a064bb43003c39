"""The gradients and training ops tvmdm.train.relax_fixes adds to TVM 0.27."""
import subprocess
import sys

import numpy as np
import pytest

from tvmdm.train import relax_fixes


STOCK_GRADIENTS = """
import tvm
names = ["relax.erf", "relax.nn.gelu", "relax.nn.layer_norm", "relax.strided_slice", "relax.einsum",
         "relax.one_hot", "relax.grad.no_grad", "relax.squeeze"]
print(",".join(n for n in names if tvm.ir.Op.get(n).get_attr("FPrimalGradient") is None))
"""


def test_stock_gradients_missing_and_ours_registered():
    # A fresh interpreter: this one may already hold ours.
    out = subprocess.run([sys.executable, "-c", STOCK_GRADIENTS], capture_output=True, text=True, check=True)
    stock_missing = out.stdout.strip().split(",")
    assert stock_missing == ["relax.erf", "relax.nn.gelu", "relax.nn.layer_norm", "relax.strided_slice",
                             "relax.einsum", "relax.one_hot", "relax.grad.no_grad", "relax.squeeze"]
    import tvm

    relax_fixes.register_missing_gradients()
    assert set(stock_missing) <= set(relax_fixes.GRADIENTS_ADDED)
    assert all(tvm.ir.Op.get(n).get_attr("FPrimalGradient") is not None for n in stock_missing)


def _grad_of(build_body, x_np, w_np):
    """Gradient w.r.t. x of sum(build_body(x) * w), compiled by TVM."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(x_np.shape), "float32"))
    w = relax.Var("w", relax.TensorType(list(w_np.shape), "float32"))
    with bb.function("f", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(relax.op.multiply(build_body(x), w)))
        bb.emit_func_output(out)
    mod = relax.transform.Gradient("f", require_grads=[x])(bb.get())
    exe = relax.build(relax.transform.LegalizeOps()(mod), target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    _, grads = vm["f_adjoint"](tvm.runtime.tensor(x_np), tvm.runtime.tensor(w_np))
    return grads[0].numpy()


@pytest.mark.parametrize("op", ["erf", "gelu", "layer_norm", "strided_slice", "squeeze"])
def test_registered_gradients_match_torch(op):
    torch = pytest.importorskip("torch")
    from tvm import relax

    relax_fixes.register_missing_gradients()
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((3, 8)).astype(np.float32)
    gamma, beta = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    relax_ops = {
        "erf": (lambda x: relax.op.erf(x), lambda t: torch.erf(t)),
        "gelu": (lambda x: relax.op.nn.gelu(x), lambda t: torch.nn.functional.gelu(t)),
        "layer_norm": (lambda x: relax.op.nn.layer_norm(x, relax.const(gamma), relax.const(beta), axes=[-1],
                                                        epsilon=1e-5),
                       lambda t: torch.nn.functional.layer_norm(t, (8,), torch.from_numpy(gamma),
                                                                torch.from_numpy(beta), 1e-5)),
        "strided_slice": (lambda x: relax.op.strided_slice(x, axes=[0, 1], begin=[1, 2], end=[3, -1]),
                          lambda t: t[1:3, 2:-1]),
        "squeeze": (lambda x: relax.op.squeeze(relax.op.strided_slice(x, axes=[0], begin=[1], end=[2]), axis=[0]),
                    lambda t: t[1]),
    }
    build, reference = relax_ops[op]
    t = torch.from_numpy(x_np).requires_grad_()
    out = reference(t)
    w_np = rng.standard_normal(tuple(out.shape)).astype(np.float32)
    (out * torch.from_numpy(w_np)).sum().backward()
    np.testing.assert_allclose(_grad_of(build, x_np, w_np), t.grad.numpy(), rtol=1e-5, atol=1e-6)


def _take_module(indices_shape):
    from tvm import relax

    bb = relax.BlockBuilder()
    table = relax.Var("table", relax.TensorType([10, 4], "float32"))
    idx = relax.Var("idx", relax.TensorType(list(indices_shape), "int64"))
    with bb.function("f", [table, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(relax.op.take(table, idx, axis=0)))
        bb.emit_func_output(out)
    return bb.get()


def test_take_gradient_with_2d_indices():
    import tvm
    from tvm import relax

    mod = _take_module([2, 3])
    stock = relax.transform.Gradient("f", require_grads=[mod["f"].params[0]])(mod)
    with pytest.raises(AssertionError):  # stock: take_backward's legalization asserts 1-d indices
        relax.transform.LegalizeOps()(stock)
    mod = relax_fixes.flatten_take_indices()(_take_module([2, 3]))
    fixed = relax.transform.Gradient("f", require_grads=[mod["f"].params[0]])(mod)
    exe = relax.build(relax.transform.LegalizeOps()(fixed), target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    idx = np.array([[1, 1, 4], [0, 9, 1]], dtype=np.int64)
    loss, grads = vm["f_adjoint"](tvm.runtime.tensor(table), tvm.runtime.tensor(idx))
    assert float(loss.numpy()) == pytest.approx(table[idx].sum())
    expected = np.zeros_like(table)
    np.add.at(expected, idx.ravel(), 1.0)  # row 1 read three times
    np.testing.assert_array_equal(grads[0].numpy(), expected)


def test_einsum_gradient_matches_torch():
    torch = pytest.importorskip("torch")
    import tvm
    from tvm import relax

    relax_fixes.register_missing_gradients()
    rng = np.random.default_rng(0)
    q_np, k_np = rng.standard_normal((2, 3, 4, 5)).astype(np.float32), rng.standard_normal((2, 3, 6, 5)).astype(
        np.float32)
    w_np = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    bb = relax.BlockBuilder()
    q, k, w = (relax.Var(n, relax.TensorType(list(a.shape), "float32")) for n, a in (("q", q_np), ("k", k_np),
                                                                                   ("w", w_np)))
    with bb.function("f", [q, k, w]):
        with bb.dataflow():
            scores = relax.op.einsum([q, k], "bhqd,bhkd->bhqk")
            out = bb.emit_output(relax.op.sum(relax.op.multiply(scores, w)))
        bb.emit_func_output(out)
    mod = relax.transform.Gradient("f", require_grads=[q, k])(bb.get())
    vm = relax.VirtualMachine(relax.build(relax.transform.LegalizeOps()(mod), target="llvm"), tvm.cpu())
    _, (dq, dk) = vm["f_adjoint"](*(tvm.runtime.tensor(a) for a in (q_np, k_np, w_np)))
    tq, tk = (torch.from_numpy(a).requires_grad_() for a in (q_np, k_np))
    (torch.einsum("bhqd,bhkd->bhqk", tq, tk) * torch.from_numpy(w_np)).sum().backward()
    np.testing.assert_allclose(dq.numpy(), tq.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk.numpy(), tk.grad.numpy(), rtol=1e-5, atol=1e-5)


def _cross_entropy_grad(loss_fn, logits_np, labels_np):
    """d loss / d logits, built the way compile_train_step builds kernels (fusion + our default schedules)."""
    import tvm
    from tvm import relax

    from schedules.default import apply_default_schedules
    from tvmdm.core.options import Options
    from tvmdm.transform.fuse import fuse

    relax_fixes.register_missing_gradients()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(logits_np.shape), "float32"))
    y = relax.Var("y", relax.TensorType(list(labels_np.shape), "int64"))
    with bb.function("f", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(loss_fn(x, y))
        bb.emit_func_output(out)
    mod = relax.transform.Gradient("f", require_grads=[x])(bb.get())
    target = tvm.target.Target("llvm")
    mod = apply_default_schedules(fuse(mod, Options(target, fusion="tvm"))[0], target)
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    loss, (grad,) = vm["f_adjoint"](tvm.runtime.tensor(logits_np), tvm.runtime.tensor(labels_np))
    return float(loss.numpy()), grad.numpy()


def test_cross_entropy_with_ignored_labels():
    torch = pytest.importorskip("torch")
    from tvm import relax

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 5)).astype(np.float32)
    labels = np.array([1, -100, 3, -100, 0, 4], np.int64)
    t = torch.from_numpy(logits).requires_grad_()
    expected = torch.nn.functional.cross_entropy(t, torch.from_numpy(labels))
    expected.backward()

    def stock(x, y):
        return relax.op.nn.nll_loss(relax.op.nn.log_softmax(x, axis=-1), y, reduction="mean", ignore_index=-100)

    loss, grad = _cross_entropy_grad(stock, logits, labels)
    assert loss == pytest.approx(expected.item(), rel=1e-6)  # the loss is right...
    ratio = grad[0] / t.grad.numpy()[0]  # ...its gradient is divided by all 6 rows, not the 4 counted
    np.testing.assert_allclose(ratio, 4 / 6, rtol=1e-5)
    loss, grad = _cross_entropy_grad(lambda x, y: relax_fixes.cross_entropy(x, y, 5, -100), logits, labels)
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-5, atol=1e-7)
