"""tvmdm.transform.isnan_bits: relax isnan -> a test of the float's bits, exact and vectorized by TVM."""
import numpy as np
import pytest

from tests.helpers.relax_calls import op_names
from tvmdm.transform.isnan_bits import LAYOUTS, isnan_as_bits, isnan_by_bits


def _module(dtype: str, n: int):
    """main(x) = where(isnan(x), 0, x), as torch's dynamo export writes the attention's probabilities."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n,), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            nan = bb.emit(relax.op.isnan(x))
            out = bb.emit_output(relax.op.where(nan, relax.const(0.0, dtype), x))
        bb.emit_func_output(out)
    return bb.get()


def _edge_values(dtype: str) -> np.ndarray:
    """NaNs of every kind (quiet, signalling, negative, largest payload), infinities, zeros, subnormals, the
    extremes, ordinary values."""
    bits, magnitude, infinity = LAYOUTS[dtype]
    unsigned = np.dtype(bits.replace("int", "uint"))
    mantissa = magnitude ^ infinity
    patterns = [infinity | 1, infinity | (mantissa + 1) >> 1, infinity | mantissa,  # NaNs: payloads 1, quiet, all
                infinity, 0, 1, infinity - 1]  # inf, +0, the smallest subnormal, the largest finite
    raw = np.array(patterns, dtype=unsigned)
    values = np.concatenate([raw, raw | np.array(magnitude + 1, dtype=unsigned)]).view(dtype)  # and negated
    finfo = np.finfo(dtype)
    ordinary = np.array([1.0, -2.5, finfo.tiny, finfo.eps, 3.0e-2], dtype=dtype)
    return np.concatenate([values, ordinary])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_bit_test_is_isnan_for_every_kind_of_value(dtype):
    import tvm
    from tvm import relax

    x = _edge_values(dtype)
    assert np.isnan(x).sum() == 6 and np.isinf(x).sum() == 2
    mod = isnan_as_bits()(_module(dtype, x.size))
    assert "relax.isnan" not in op_names(mod["main"])
    vm = relax.VirtualMachine(relax.build(relax.transform.LegalizeOps()(mod), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, np.where(np.isnan(x), 0, x))


def test_the_kernel_vectorizes_where_topis_isnan_is_scalarized():
    """TVM's VectorizeLoop scalarizes a loop that calls tirx.isnan (the SM rows' normalization of dynamo
    exports was 16 scalar compares and branches a vector); the bit test stays one vector."""
    import tvm
    from tvm import te, topi
    from tvm.s_tir import Schedule

    def vectorized(compute) -> str:
        """The kernel as VectorizeLoop left it, on the way through tvm.compile."""
        x = te.placeholder((64,), "float32", name="x")
        sch = Schedule(te.create_prim_func([x, compute(x)]))
        sch.vectorize(sch.get_loops(sch.get_child_blocks(sch.get_sblock("root"))[0])[0])
        seen = []

        @tvm.instrument.pass_instrument
        class AfterVectorize:
            def run_after_pass(self, mod, info):
                if info.name == "tirx.VectorizeLoop":
                    seen.append(mod.script())

        with tvm.transform.PassContext(instruments=[AfterVectorize()]):
            tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target="llvm")
        return seen[0]

    assert "_s in" in vectorized(topi.isnan)  # the loop TVM scalarized (its variable renamed ..._s)
    script = vectorized(isnan_by_bits)
    assert "_s in" not in script and "int32x64" in script


def test_every_function_of_the_module_is_rewritten():
    """The SM pattern's composite functions hold the isnan of dynamo exports."""
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, wildcard

    probs = wildcard()
    pattern = is_op("relax.where")(is_op("relax.isnan")(probs), is_const(), probs)
    mod = relax.transform.FuseOpsByPattern([("sm_tail", pattern)], bind_constants=True, annotate_codegen=False)(
        _module("float32", 16))
    composite = [gv for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs is not None
                 and "Composite" in f.attrs]
    assert len(composite) == 1 and "relax.isnan" in op_names(mod[composite[0]])
    rewritten = isnan_as_bits()(mod)
    assert "relax.isnan" not in op_names(rewritten[composite[0]])
