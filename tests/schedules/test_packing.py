"""schedules.packed.schedule_pair_pack: the bf16 packing [N/16, K/2, 16, 2] of weights and dY that a training
step makes every step, against numpy over its layouts (plain and transposed sources, the merged QKV's
concatenation, leading batch dims)."""
import numpy as np
import pytest
import tvm
from tvm import te, topi

from schedules.packed import schedule_pair_pack
from tvmdm.core.target import make_target
from tvmdm.transform.kernels import BF16, bf16_bits, int64_dims, pack_weight_func, packed_shape


def _bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _packed(w: np.ndarray) -> np.ndarray:
    """[..., K, N] -> bf16 bits as [..., N/16, K/2, 16, 2]."""
    *lead, k, n = w.shape
    bits = _bits(w).reshape(*lead, k // 2, 2, n // 16, 16)
    return np.moveaxis(bits, (-4, -3, -2, -1), (-3, -1, -4, -2)).copy()


def _run(func, out_shape, *arrays):
    scheduled = schedule_pair_pack(func.with_attr("global_symbol", "main"), BF16.pack_name)
    assert scheduled.attrs["tirx.is_scheduled"]
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=make_target("llvm"))
    out = tvm.runtime.tensor(np.zeros(out_shape, np.uint16))
    lib["main"](*(tvm.runtime.tensor(a) for a in arrays), out)
    return out.numpy()


@pytest.mark.parametrize("k, n, transposed, batch", [(96, 64, False, ()), (96, 64, True, ()), (20, 48, False, ()),
                                                     (64, 32, True, (2, 3)), (64, 32, False, (2,))])
def test_pack_matches_numpy(k, n, transposed, batch):
    w = np.random.default_rng(0).standard_normal(batch + ((n, k) if transposed else (k, n))).astype(np.float32)
    got = _run(pack_weight_func(k, n, transposed, batch), batch + tuple(packed_shape(k, n)), w)
    np.testing.assert_array_equal(got, _packed(np.swapaxes(w, -1, -2) if transposed else w))


def test_merged_qkv_pack_of_a_concatenation_matches_numpy():
    k, n = 64, 96  # three [64, 32] weights side by side
    parts = [te.placeholder(int64_dims((k, n // 3)), "float32", name=f"w{i}") for i in range(3)]
    merged = topi.concatenate(parts, axis=1)
    out = te.compute(int64_dims(packed_shape(k, n)), lambda no, ko, ni, ki: bf16_bits(
        merged[ko * 2 + ki, no * 16 + ni]), name=BF16.pack_name)
    func = te.create_prim_func([*parts, out])
    ws = [np.random.default_rng(i).standard_normal((k, n // 3)).astype(np.float32) for i in range(3)]
    np.testing.assert_array_equal(_run(func, packed_shape(k, n), *ws), _packed(np.concatenate(ws, axis=1)))
