"""schedules.amx_attention: the attention of symbolic sequences in one AMX kernel (scores, softmax, context).

The kernel is checked against a numpy reference over its layouts (queries row-major, keys and values packed as
B tiles, the output [B, L, H, D]) with every tile instruction emulated, on any CPU; with the tile units where
the host has them. The Sapphire Rapids kind's module is built and its code checked on every machine."""
import warnings

import numpy as np
import pytest
import tvm

import tvmdm
from schedules.amx_attention import TileAttention, fast_exp, tile_attention_kernel
from schedules.pipeline import scheduled_by
from tests.helpers.cpu_kinds import BY_NAME, asm_of, function_asm
from tvmdm.models import BertConfig, build_encoder_layer
from tvmdm.runtime import amx as amx_runtime
from tvmdm.transform.tile_attention import KEY_BLOCK

LAYER = BertConfig(hidden=96, heads=3, ffn=192, batch=2, seq=32)  # heads of 32
SPR = BY_NAME["sapphirerapids"]


def _bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _operands(batch, seq, heads, dim, seed=0, per_query=False):
    """(q, k, v, mask, blocks) in the kernel's layouts, and numpy's softmax(Q K^T / sqrt(d) + mask) V of the
    same bf16 values ([B, S, H, D]); batch 0's last keys masked with -10000, batch 1's every key with -inf;
    ``per_query``: a mask [B, L, L] whose query i also masks its keys after i (causal)."""
    blocks = -(-seq // KEY_BLOCK)
    length = blocks * KEY_BLOCK
    rng = np.random.default_rng(seed)
    q, k, v = (np.pad(_value(_bits(rng.standard_normal((batch, heads, seq, dim)))),
                      [(0, 0), (0, 0), (0, length - seq), (0, 0)]) for _ in range(3))
    mask = np.full((batch, length), -np.inf, np.float32)
    mask[:, :seq] = 0
    mask[0, seq // 2:seq] = -10000.0
    if batch > 1:
        mask[1] = -np.inf
    mask = mask[:, None, :]
    if per_query:
        causal = np.where(np.arange(length)[None, :] > np.arange(length)[:, None], -10000.0, 0.0)
        mask = (mask + causal[None]).astype(np.float32)
    k_tiles = _bits(k).reshape(batch, heads, length // 16, 16, dim // 2, 2).transpose(0, 1, 2, 4, 3, 5)
    v_pairs = _bits(v).reshape(batch, heads, length // 2, 2, dim // 16, 16).transpose(0, 1, 4, 2, 5, 3)
    v_tiles = v_pairs[..., 0].astype(np.uint32) | (v_pairs[..., 1].astype(np.uint32) << 16)
    scale = 1 / np.sqrt(dim)
    with np.errstate(invalid="ignore"):
        logits = np.einsum("bhid,bhjd->bhij", q, k) * scale + mask[:, None]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs = np.nan_to_num(probs / probs.sum(-1, keepdims=True))  # a row of -inf keys: 0
    ref = np.einsum("bhij,bhjd->bihd", _value(_bits(probs)), v)[:, :seq]
    args = [_bits(q), np.ascontiguousarray(k_tiles), np.ascontiguousarray(v_tiles), mask]
    return args, blocks, scale, ref


def _run(kernel, args, blocks, out_shape):
    lib = tvm.compile(tvm.IRModule({"main": kernel}), target=tvmdm.core.target.make_target("llvm"))
    out = tvm.runtime.tensor(np.zeros(out_shape, np.float32))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], blocks, out)
    return out.numpy()


@pytest.mark.parametrize("batch, seq, heads, dim, per_query", [(2, 45, 2, 64, False), (1, 32, 3, 32, False),
                                                            (2, 7, 1, 96, False), (2, 40, 2, 32, True)])
def test_emulated_kernel_matches_numpy(batch, seq, heads, dim, per_query):
    args, blocks, scale, ref = _operands(batch, seq, heads, dim, per_query=per_query)
    got = _run(tile_attention_kernel(heads, dim, float(scale), per_query, emulate=True), args, blocks,
               (batch, blocks * KEY_BLOCK, heads, dim))[:, :seq]
    # the probabilities' bf16 rounding after fast_exp may differ by one step from numpy's
    np.testing.assert_allclose(got, ref, atol=4e-3 * np.abs(ref).max())
    if batch > 1:
        assert not got[1].any()  # every key masked with -inf: zeros, as torch's export gives


@pytest.mark.skipif(not amx_runtime.host_has_amx(), reason="the host has no AMX-BF16 tile units")
def test_kernel_on_tiles_matches_numpy():
    amx_runtime.request_tile_state()
    for per_query in (False, True):
        args, blocks, scale, ref = _operands(2, 77, 3, 64, per_query=per_query)
        got = _run(tile_attention_kernel(3, 64, float(scale), per_query), args, blocks,
                   (2, blocks * KEY_BLOCK, 3, 64))[:, :77]
        np.testing.assert_allclose(got, ref, atol=4e-3 * np.abs(ref).max())


def test_fast_exp_is_within_bf16s_step():
    x = tvm.te.placeholder((4096,), "float32", name="x")
    y = tvm.te.compute(x.shape, lambda i: fast_exp(x[i]), name="y")
    lib = tvm.compile(tvm.te.create_prim_func([x, y]), target="llvm")
    xs = np.concatenate([-np.geomspace(1e-6, 120, 4094), [0, -np.inf]]).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros(4096, np.float32))
    lib(tvm.runtime.tensor(xs), out)
    want = np.exp(xs.astype(np.float64))
    assert np.all(np.abs(out.numpy() - want) <= 2e-5 * want + 1e-37)


def test_sapphire_rapids_runs_symbolic_attention_in_one_tile_kernel():
    compiled = tvmdm.compile(build_encoder_layer(LAYER), shapes={}, target=SPR.target(), precision="bf16",
                             tuning_logs=None)
    assert scheduled_by(compiled.mod, TileAttention()) == sorted(
        ["tile_attention"] + [k for k in compiled.kernels if k.endswith(("_q", "_k", "_v"))])
    assert not [k for k in compiled.kernels if k.startswith(("sm", "attention_context", "pad_keys"))]
    lines = function_asm(asm_of(compiled), "tile_attention_compute_")
    body = "\n".join(lines)
    # scores and context on the tiles: 4 tdpbf16ps per step of each
    assert body.count("tdpbf16ps") == 8 and "ldtilecfg" in body and "tilerelease" in body
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Zen 4 has no tiles: asserted in test_amx
        zen4 = tvmdm.compile(build_encoder_layer(LAYER), shapes={}, target=BY_NAME["zen4"].target(),
                             precision="bf16", tuning_logs=None)
    assert "sm" in zen4.kernels and "tile_attention" not in zen4.kernels  # no tiles: the paper's SM


def test_heads_off_the_tiles_keep_the_papers_kernels():
    layer = BertConfig(hidden=96, heads=4, ffn=192, batch=2, seq=32)  # heads of 24
    compiled = tvmdm.compile(build_encoder_layer(layer), shapes={}, target=SPR.target(), precision="bf16",
                             tuning_logs=None)
    assert "sm" in compiled.kernels and "tile_attention" not in compiled.kernels


@pytest.mark.parametrize("family, dynamo", [("bert", False), ("bert", True), ("distilbert", False),
                                            ("roberta", True)])
def test_hf_exports_masks_of_a_row_per_query_take_the_tile_kernel(hf_export, family, dynamo):
    # HF's exports expand the mask to [B, 1, S, S] and zero the NaNs of fully masked rows after the softmax
    from tvmdm.core.precision import BF16_MAX_REL_ERR

    path = hf_export(family, dynamo=dynamo, opset=18 if dynamo else 17, size="tiny-tiles")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = tvmdm.compile(path, target=SPR.target(), precision="bf16", tuning_logs=None)
    assert "tile_attention" in built.kernels and "sm" not in built.kernels
    if not amx_runtime.host_has_amx():
        pytest.skip("the host has no AMX-BF16 tile units: built and checked, not run")
    compiled = tvmdm.compile(path, precision="bf16", tuning_logs=None)
    inputs = tvmdm.random_inputs(compiled, batch=2, seq=37)
    inputs["attention_mask"][1, 20:] = 0
    got, ref = compiled.run(inputs), compiled.reference(inputs)
    err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))
    assert 0 < err <= BF16_MAX_REL_ERR
