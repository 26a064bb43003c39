"""fold_reshaped_transposes: reshape / transpose / reshape chains that only permute axes become one permute_dims."""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import tvmdm
from tvmdm.analysis.profile import call_sites
from tvmdm.models import hf_export as hf_exports
from tvmdm.transform.ir import bindings_of, call_op
from tvmdm.transform.reshaped_transposes import fold_reshaped_transposes, permutation_of

ANALYZER = tvm.sym.Analyzer()


def _equal(a, b):
    return bool(ANALYZER.can_prove_equal(a, b))


def _dims(*sizes):
    return [tirx.IntImm("int64", s) if isinstance(s, int) else s for s in sizes]


@pytest.mark.parametrize("batch", [2, 1])
def test_dynamo_keys_transpose_is_a_permutation(batch):
    # K [B, h, S, d] -> [B*h, S, d] -> transpose(1, 2) -> [B, h, d, S]; at B=1 the merged dim is h alone
    order = permutation_of(_dims(batch, 12, 16, 64), _dims(batch * 12, 16, 64), [0, 2, 1],
                           _dims(batch, 12, 64, 16), _equal)
    assert order == [0, 1, 3, 2]


def test_symbolic_dims_are_compared_by_arith():
    b, s = tirx.Var("batch", "int64"), tirx.Var("seq", "int64")
    order = permutation_of(_dims(b, 12, s, 64), _dims(b * 12, s, 64), [0, 2, 1], _dims(b, 12, 64, s), _equal)
    assert order == [0, 1, 3, 2]


@pytest.mark.parametrize("merged, axes, result", [
    ([24, 32, 32], [0, 2, 1], [2, 12, 32, 32]),   # the first reshape splits an axis: not a merge
    ([24, 16, 64], [0, 2, 1], [2, 12, 16, 64]),   # the result's dims are not the permuted axes'
    ([2, 192, 64], [0, 2, 1], [2, 64, 192]),      # a merged run stays merged: a real reshape
])
def test_chains_that_do_more_than_permute_are_left_alone(merged, axes, result):
    assert permutation_of(_dims(2, 12, 16, 64), _dims(*merged), axes, _dims(*result), _equal) is None


def _chain_module(shape, merged, axes, result):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            r = bb.emit(relax.op.reshape(x, merged))
            p = bb.emit(relax.op.permute_dims(r, axes))
            out = bb.emit_output(relax.op.reshape(p, result))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, x):
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("merged, axes, result, folded", [
    ([24, 16, 8], [0, 2, 1], [2, 12, 8, 16], True),   # dynamo's K^T: one permute_dims, same numbers
    ([2, 12, 128], [0, 1, 2], [2, 12, 16, 8], True),  # an identity chain: x itself
    ([2, 192, 8], [0, 2, 1], [2, 8, 192], False),     # a real reshape stays
])
def test_the_pass_folds_permutations_and_keeps_the_numbers(merged, axes, result, folded):
    mod = _chain_module([2, 12, 16, 8], merged, axes, result)
    after = fold_reshaped_transposes()(mod)
    ops = [call_op(v) for v in bindings_of(after["main"]).values()]
    assert ("relax.reshape" not in ops) == folded
    if folded:
        assert ops.count("relax.permute_dims") == (axes != [0, 1, 2])
    x = np.random.default_rng(0).standard_normal((2, 12, 16, 8)).astype("float32")
    np.testing.assert_array_equal(_run(after, x), _run(mod, x))


def _layout_copies(compiled) -> list[str]:
    """Kernels main calls that only move data between layouts (a transpose among slices, squeezes and
    reshapes; the weights' transposes at load are not main's)."""
    moves = {"strided_slice", "squeeze", "transpose", "reshape", "permute_dims"}
    return [k for k in call_sites(compiled.mod) if set(compiled.kernel_ops.get(k, ())) <= moves
            and {"transpose", "permute_dims"} & set(compiled.kernel_ops.get(k, ()))]


@pytest.mark.parametrize("dynamic", [False, True])
def test_dynamo_exports_keep_no_keys_transpose_kernel(hf_export, dynamic):
    # each layer of a dynamo export copied K^T out of the packed QKV output (fused_strided_slice_squeeze_
    # transpose_reshape_transpose_reshape) before this pass; now SM reads the keys in place, as for the
    # legacy export
    compiled = tvmdm.compile(hf_export("bert", dynamo=True, dynamic=dynamic, opset=18))
    assert _layout_copies(compiled) == []
    assert compiled.check(hf_exports.sample_inputs("bert")).ok
