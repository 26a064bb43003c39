"""The backward-graph rewrites (tvmdm.backward): each weight gradient one contraction over all rows, its left
operand read transposed in place; numbers against numpy and Relax's own gradient."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

import tvmdm
from tvmdm.train.backward import flat_weight_gradients, transposed_left_contractions
from tvmdm.transform.ir import bindings_of, call_op
from tvmdm.analysis.profile import call_sites


def _ops(func) -> list[str]:
    return [call_op(v) for v in bindings_of(func).values()]


@tvm.script.ir_module
class WeightGradient:
    """Relax Gradient's dW of x [2, 8, 16] @ W [16, 32], as it writes it."""

    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32"), dy: R.Tensor((2, 8, 32), "float32")) -> R.Tensor((16, 32), "float32"):
        with R.dataflow():
            xt = R.permute_dims(x, [0, 2, 1])
            mm = R.matmul(xt, dy)
            dw = R.collapse_sum_to(mm, R.shape([16, 32]))
            R.output(dw)
        return dw


def _run(mod, *args):
    from tvmdm.transform.fuse import lowering_passes

    lowered = tvm.transform.Sequential(lowering_passes() + [relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    vm = relax.VirtualMachine(relax.build(lowered, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def test_weight_gradient_becomes_one_contraction_over_all_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    dy = rng.standard_normal((2, 8, 32)).astype(np.float32)
    want = np.einsum("bsk,bsn->kn", x, dy)

    flat = flat_weight_gradients()(WeightGradient)
    ops = _ops(flat["main"])
    assert "relax.collapse_sum_to" not in ops
    (mm,) = [v for v in bindings_of(flat["main"]).values() if call_op(v) == "relax.matmul"]
    assert [int(d) for d in mm.args[1].ty.shape.values] == [16, 32]  # dY viewed as [B*S, N]
    np.testing.assert_allclose(_run(flat, x, dy), want, rtol=1e-5, atol=1e-5)

    in_place = transposed_left_contractions()(flat)
    ops = _ops(in_place["main"])
    assert "relax.permute_dims" not in ops and "relax.matmul" not in ops
    assert "matmul_tn" in [gv.name_hint for gv in in_place.get_global_vars()]
    np.testing.assert_allclose(_run(in_place, x, dy), want, rtol=1e-5, atol=1e-5)


def test_other_contractions_are_left_alone():
    @tvm.script.ir_module
    class Other:
        @R.function
        def main(x: R.Tensor((2, 8, 16), "float32"), dy: R.Tensor((2, 16, 32), "float32")):
            with R.dataflow():
                mm = R.matmul(x, dy)  # no transposed left operand
                s = R.collapse_sum_to(mm, R.shape([8, 32]))
                R.output(s)
            return s

    for rewrite in (flat_weight_gradients(), transposed_left_contractions()):
        tvm.ir.assert_structural_equal(rewrite(Other), Other)


def _arg_shapes(func) -> list[list[int]]:
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    return [[int(d) for d in a.shape] for a in ArgInfo.from_prim_func(func)]


def test_training_step_gradients_read_operands_in_place(tiny_layer):
    step = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, tuning_logs=None, fusion="tvm")
    kernels = call_sites(step.mod, "train_step")
    # stock fusion: the six weight matrices' gradients (Q, K, V, output, FFN up, FFN down) are matmul_tn over all 16 rows
    tn = {k: n for k, n in kernels.items() if "matmul_tn" in k}
    assert sum(tn.values()) == 6 and all(_arg_shapes(step.mod[k])[0][0] == 16 for k in tn)
    # no batched weight gradient summed afterwards: the only collapse_sum left are bias gradients (1-D)
    assert all(len(_arg_shapes(step.mod[k])[-1]) == 1 for k in kernels if "collapse_sum" in k)
    # no activation [B, S, K] is transposed by a kernel: what is left are weights (2-D: the packing of the
    # input gradients' dY W^T) and the attention's heads (4-D)
    assert all(len(_arg_shapes(step.mod[k])[0]) in (2, 4) for k in kernels if k.startswith("transpose"))


@tvm.script.ir_module
class GeluLoss:
    """sum(GELU(x + b) * w), GELU as torch's ONNX exporter writes it (Div, Erf, Add, Mul, Mul)."""

    @R.function
    def main(x: R.Tensor((4, 32), "float32"), w: R.Tensor((4, 32), "float32"),
             b: R.Tensor((32,), "float32")) -> R.Tensor((), "float32"):
        with R.dataflow():
            h = R.add(x, b)
            s = R.divide(h, R.const(1.4142135381698608, "float32"))
            a = R.add(R.erf(s), R.const(1.0, "float32"))
            g = R.multiply(R.multiply(h, a), R.const(0.5, "float32"))
            loss = R.sum(R.multiply(g, w))
            R.output(loss)
        return loss


def _gelu_gradient_module() -> tvm.IRModule:
    """GeluLoss's gradient w.r.t. x and b as Relax's Gradient writes it, as the module's main."""
    from tvmdm.train import relax_fixes

    relax_fixes.register_missing_gradients()  # erf's among them
    adjoint = relax.transform.Gradient("main", require_grads=None)(GeluLoss)["main_adjoint"]
    return tvm.IRModule({"main": adjoint.with_attr("global_symbol", "main")})


def _run_tuple(mod, *args) -> list[np.ndarray]:
    from tvmdm.transform.fuse import lowering_passes

    lowered = tvm.transform.Sequential(lowering_passes() + [relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    vm = relax.VirtualMachine(relax.build(lowered, target="llvm"), tvm.cpu())
    loss, grads = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [loss.numpy()] + [g.numpy() for g in grads]


def test_gelu_gradient_is_recomputed_from_the_pre_activation():
    from scipy.special import erf

    from tvmdm.train.backward_kernels import recompute_gelu_gradient

    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal((4, 32)).astype(np.float32) for _ in range(2))
    b = rng.standard_normal(32).astype(np.float32)
    h = (x + b).astype(np.float64)
    dh = w * (0.5 * (1 + erf(h / np.sqrt(2))) + h * np.exp(-h * h / 2) / np.sqrt(2 * np.pi))

    gradient = _gelu_gradient_module()
    rewritten = recompute_gelu_gradient()(gradient)
    before, after = _ops(gradient["main"]), _ops(rewritten["main"])
    # Gradient's form reads the forward's 1 + erf(x / sqrt2) and multiplies by 2/sqrt(pi) and 1/sqrt2 apart;
    # the recomputed one evaluates erf again (so the forward's need not be kept) and has one divide by sqrt2
    assert after.count("relax.erf") == 2 and before.count("relax.erf") == 1
    assert before.count("relax.divide") == 2 and after.count("relax.divide") == 2  # forward s and recomputed s
    for got in (_run_tuple(gradient, x, w, b), _run_tuple(rewritten, x, w, b)):
        np.testing.assert_allclose(got[1], dh, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[3], dh.sum(0), rtol=1e-5, atol=1e-4)
    # a gradient without GELU is left alone
    tvm.ir.assert_structural_equal(recompute_gelu_gradient()(WeightGradient), WeightGradient)
