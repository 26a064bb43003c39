"""The paper's graph rewrites as passes on their own: a Before module through the pass gives the Expected one
(structural equality), and modules the pass does not apply to come back unchanged."""
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvmdm.transform.graph_rewrites import drop_noop_reshapes, hoist_operand_scales


@I.ir_module
class ReshapeToItsOwnShape:
    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32")):
        with R.dataflow():
            y = R.reshape(x, R.shape([2, 4, 8]))
            z = R.add(y, y)
            w = R.reshape(z, R.shape([8, 8]))  # a real reshape: stays
            R.output(w)
        return w


@I.ir_module
class ReshapeDropped:
    @R.function
    def main(x: R.Tensor((2, 4, 8), "float32")):
        with R.dataflow():
            z = R.add(x, x)
            w = R.reshape(z, R.shape([8, 8]))
            R.output(w)
        return w


def test_drop_noop_reshapes():
    tvm.ir.assert_structural_equal(drop_noop_reshapes()(ReshapeToItsOwnShape), ReshapeDropped)


def test_drop_noop_reshapes_leaves_real_reshapes():
    tvm.ir.assert_structural_equal(drop_noop_reshapes()(ReshapeDropped), ReshapeDropped)


@I.ir_module
class ScaledOperands:
    @R.function
    def main(q: R.Tensor((1, 2, 4, 8), "float32"), k: R.Tensor((1, 2, 8, 4), "float32")):
        with R.dataflow():
            qs = R.multiply(q, R.const(0.5, "float32"))
            ks = R.multiply(k, R.const(0.25, "float32"))
            s = R.matmul(qs, ks)
            R.output(s)
        return s


@I.ir_module
class ScaleHoisted:
    @R.function
    def main(q: R.Tensor((1, 2, 4, 8), "float32"), k: R.Tensor((1, 2, 8, 4), "float32")):
        with R.dataflow():
            product = R.matmul(q, k)
            s = R.multiply(product, R.const(0.125, "float32"))
            R.output(s)
        return s


def test_hoist_operand_scales_makes_one_scale_of_the_product():
    tvm.ir.assert_structural_equal(hoist_operand_scales()(ScaledOperands), ScaleHoisted)


@I.ir_module
class ScaleReadTwice:
    @R.function
    def main(q: R.Tensor((1, 2, 4, 8), "float32"), k: R.Tensor((1, 2, 8, 4), "float32")):
        with R.dataflow():
            qs = R.multiply(q, R.const(0.5, "float32"))
            s = R.matmul(qs, k)
            t = R.add(qs, qs)  # the scaled q is read elsewhere: hoisting would compute it twice
            R.output(s, t)
        return (s, t)


def test_hoist_operand_scales_leaves_a_scale_that_is_read_elsewhere():
    tvm.ir.assert_structural_equal(hoist_operand_scales()(ScaleReadTwice), ScaleReadTwice)


def test_absorb_transposes_reads_a_permute_dims_without_axes_as_reversed():
    # permute_dims with no axes reverses them (as ONNX's Transpose without perm); absorbing the one after the
    # contraction took it as swapping the last two
    import numpy as np
    from tvm import relax

    from tvmdm.transform.graph_rewrites import absorb_transposes
    from tvmdm.transform.ir import bindings_of, call_op

    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((1, 2, 4, 8), "float32"))
    b = relax.Var("b", relax.TensorType((1, 2, 8, 6), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.permute_dims(bb.emit(relax.op.matmul(a, b))))
        bb.emit_func_output(out)
    before = bb.get()
    after = absorb_transposes()(before)
    assert [call_op(v) for v in bindings_of(after["main"]).values()] == ["relax.einsum"]
    rng = np.random.default_rng(0)
    inputs = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in ((1, 2, 4, 8), (1, 2, 8, 6))]
    run = lambda mod: relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())["main"](*inputs).numpy()  # noqa: E731
    np.testing.assert_allclose(run(after), run(before), rtol=1e-6)
