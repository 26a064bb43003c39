"""tvmdm.transform.constant_divisors: divisions by a float scalar constant that only an approximated function
(erf, tanh, exp) reads become multiplies by the constant's reciprocal; every other division stays exact."""
import numpy as np
import pytest

from tests.helpers.relax_calls import op_names
from tvmdm.transform.constant_divisors import divide_by_reciprocal


def _module(divisor, dtype="float32", reader="relax.erf", also_returned=False):
    """main(x, d) = reader(x / divisor) (divisor None: by d), and the quotient itself if ``also_returned``."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), dtype))
    d = relax.Var("d", relax.TensorType((), dtype))
    with bb.function("main", [x, d]):
        with bb.dataflow():
            quotient = bb.emit(relax.op.divide(x, d if divisor is None else relax.const(divisor, dtype)))
            read = bb.emit(getattr(relax.op, reader.split(".")[1])(quotient)) if reader else quotient
            out = bb.emit_output(relax.Tuple([read, quotient]) if also_returned else read)
        bb.emit_func_output(out)
    return bb.get()


def _quotient(mod, x, d):
    """main's quotient (the module's divide or its rewrite) as the function computes it."""
    import tvm
    from tvm import relax

    func = mod["main"]
    body = func.body
    quotient = body.blocks[0].bindings[0].var
    mod = tvm.IRModule({"main": relax.Function(func.params, relax.SeqExpr(body.blocks, quotient), quotient.ty)})
    vm = relax.VirtualMachine(relax.build(relax.transform.LegalizeOps()(mod), target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(d, x.dtype))).numpy()


@pytest.mark.parametrize("divisor", [1.4142135, 3.0, -7.25])
def test_a_quotient_only_erf_reads_is_the_product_by_the_reciprocal_within_an_ulp(divisor):
    """GELU's erf(x / sqrt(2)): the quotient is within an ulp of the exact one."""
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 10
    mod = _module(divisor)
    rewritten = divide_by_reciprocal(quantized_only=False)(mod)
    assert op_names(mod["main"]) == ["relax.divide", "relax.erf"]
    assert op_names(rewritten["main"]) == ["relax.multiply", "relax.erf"]
    quotient = x / np.float32(divisor)
    product = _quotient(rewritten, x, divisor)
    ulps = np.abs(product.view(np.int32).astype(np.int64) - quotient.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1


@pytest.mark.parametrize("divisor, dtype, reader, also_returned", [
    (None, "float32", "relax.erf", False),  # not a constant
    (0.0, "float32", "relax.erf", False),  # x / 0 is inf or nan, x * inf is not the same
    (float("inf"), "float32", "relax.erf", False),
    (3, "int32", None, False),  # an integer division
    (255.0, "float32", None, False),  # read exactly (DynamicQuantizeLinear's scale, (max - min) / 255)
    (255.0, "float32", "relax.round", False),
    (1.4142135, "float32", "relax.erf", True),  # read by erf and as it is
])
def test_other_divisions_are_left_as_they_are(divisor, dtype, reader, also_returned):
    mod = _module(divisor, dtype, reader, also_returned)
    assert op_names(divide_by_reciprocal(quantized_only=False)(mod)["main"])[0] == "relax.divide"


def test_every_function_of_the_module_is_rewritten():
    """Composite functions (FuseOpsByPattern) hold divisions too, as a training module's other functions do."""
    from tvm import relax
    from tvm.relax.dpl import is_op, wildcard

    pattern = is_op("relax.erf")(is_op("relax.divide")(wildcard(), wildcard()))
    mod = relax.transform.FuseOpsByPattern([("gelu_part", pattern)], bind_constants=True, annotate_codegen=False)(
        _module(1.4142135))
    rewritten = divide_by_reciprocal(quantized_only=False)(mod)
    composite = [gv for gv, f in rewritten.functions_items() if isinstance(f, relax.Function) and f.attrs is not None
                 and "Composite" in f.attrs]
    assert len(composite) == 1 and op_names(rewritten[composite[0]]) == ["relax.multiply", "relax.erf"]


def test_fp32_modules_keep_their_divisions_by_default():
    """Their kernels are what the shipped tuning records were tuned on (a changed FFN1 kernel lost its record)."""
    mod = _module(1.4142135)
    assert op_names(divide_by_reciprocal()(mod)["main"]) == ["relax.divide", "relax.erf"]
