"""schedules.amx: bf16 contractions on the AMX tile units (Sapphire Rapids).

Built for the Sapphire Rapids kind on every machine and checked in the generated code (the tile configuration
loaded by each parallel task, tile loads and tdpbf16ps, the packed weight layout). The same schedules run on any
CPU with each tile instruction emulated by the loops it stands for (schedules.amx.EMULATE): that checks every
tile's rows, columns and addresses, the epilogues and the packing against numpy, onnxruntime and the bf16 step
without tiles. The instructions themselves run only where the host has AMX."""
import re
import warnings

import numpy as np
import pytest
import tvm

import tvmdm
from schedules import amx
from schedules.pipeline import scheduled_by
from tests.helpers.cpu_kinds import BY_NAME, asm_of, function_asm
from tvmdm.core.errors import TvmdmError
from tvmdm.core.precision import BF16_MAX_REL_ERR
from tvmdm.core.target import has_amx_bf16, has_int8_dot, make_target
from tvmdm.models import BertConfig, build_encoder_layer
from tvmdm.runtime import amx as amx_runtime
from tvmdm.transform.kernels import TILE_ROW_PAD, gemm_func

# hidden and FFN whole 32-column blocks, 64 rows in all; heads of 32 and 32 keys: the attention's contractions
# fill whole tiles too
LAYER = BertConfig(hidden=96, heads=3, ffn=192, batch=2, seq=32)
SHAPES = {"hidden_states": [2, 32, 96], "attention_mask": [2, 32]}
SPR = BY_NAME["sapphirerapids"]
TILE_OPS = ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(amx, "EMULATE", True)


def _bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _layer_bf16(target, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shipped logs' warnings: asserted in their own tests
        return tvmdm.compile(build_encoder_layer(LAYER), shapes=SHAPES, target=target, precision="bf16", **options)


def test_tile_configuration_bytes():
    config = b"".join(w.to_bytes(8, "little") for w in amx.tile_config_words())
    assert config[0] == 1 and not any(config[1:16])  # palette 1
    assert [int.from_bytes(config[16 + 2 * t:18 + 2 * t], "little") for t in range(16)] == [64] * 8 + [0] * 8
    assert list(config[48:64]) == [16] * 8 + [0] * 8  # 16 rows for tiles 0-7, the rest unused


@pytest.mark.parametrize("lead, k, n", [((2, 64), 96, 64), ((256,), 64, 32), ((3, 16), 32, 96), ((48,), 64, 64)])
def test_emulated_tiles_match_numpy(lead, k, n):
    # 32-row blocks in groups of 2 / 4 / 1 (48 rows: 16-row blocks, 3 of them), 16-row blocks, leading dims
    func = gemm_func(lead, k, n).with_attr("global_symbol", "main")
    scheduled = amx.schedule_amx_gemm(func, emulate=True)
    assert scheduled is not None
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=make_target("llvm"))
    rng = np.random.default_rng(0)
    x, w = _bits(rng.standard_normal(lead + (k,))), _bits(rng.standard_normal((k, n)))
    packed = w.reshape(k // 2, 2, n // 16, 16).transpose(2, 0, 3, 1).copy()  # [N/16, K/2, 16, 2]
    out = tvm.runtime.tensor(np.zeros(lead + (n,), np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(packed), out)
    ref = _value(x).astype(np.float64) @ _value(w).astype(np.float64)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("batch, seq, n, panel_bytes", [(2, 5, 64, amx.PANEL_BYTES), (1, 32, 64, amx.PANEL_BYTES),
                                                        (3, 40, 192, 3 * 32 * 64 * 2), (2, 33, 96, 1)])
def test_emulated_tiles_of_symbolic_rows_match_numpy(batch, seq, n, panel_bytes, monkeypatch):
    # one module for every (batch, seq): the operand comes with its rows padded to whole 32-row blocks
    # (to_bf16_func), the rows past seq are computed and never written out; units cover the weight columns
    # in panels (all of them, 3 of 6 blocks, one block)
    monkeypatch.setattr(amx, "PANEL_BYTES", panel_bytes)
    k = 64
    lead = (tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64"))
    scheduled = amx.schedule_amx_gemm(gemm_func(lead, k, n).with_attr("global_symbol", "main"), emulate=True)
    assert scheduled is not None
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=make_target("llvm"))
    rng = np.random.default_rng(0)
    padded = -(-seq // TILE_ROW_PAD) * TILE_ROW_PAD
    x = _bits(rng.standard_normal((batch, padded, k)))
    w = _bits(rng.standard_normal((k, n)))
    packed = w.reshape(k // 2, 2, n // 16, 16).transpose(2, 0, 3, 1).copy()
    out = tvm.runtime.tensor(np.zeros((batch, seq, n), np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(packed), out)
    ref = _value(x[:, :seq]).astype(np.float64) @ _value(w).astype(np.float64)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows, panel_bytes, units", [(256, amx.PANEL_BYTES, 8), (256, 1, 24), (128, amx.PANEL_BYTES, 3)])
def test_static_rows_of_enough_blocks_take_the_panel_units(rows, panel_bytes, units, monkeypatch):
    # from PANEL_MIN_BLOCKS blocks of 32 rows on, a unit is one block of rows over a panel of columns (all 3
    # blocks of 32, or one when the panel bytes allow one), as for symbolic rows; below, GROUPS blocks of rows
    # (128 rows: 4) by one block of columns
    monkeypatch.setattr(amx, "PANEL_BYTES", panel_bytes)
    k, n = 64, 96
    scheduled = amx.schedule_amx_gemm(gemm_func((rows,), k, n).with_attr("global_symbol", "main"), emulate=True)
    assert re.findall(r"T\.parallel\((?:T\.int64\()?(\d+)", scheduled.script()) == [str(units)]
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=make_target("llvm"))
    rng = np.random.default_rng(0)
    x, w = _bits(rng.standard_normal((rows, k))), _bits(rng.standard_normal((k, n)))
    packed = w.reshape(k // 2, 2, n // 16, 16).transpose(2, 0, 3, 1).copy()
    out = tvm.runtime.tensor(np.zeros((rows, n), np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(packed), out)
    ref = _value(x).astype(np.float64) @ _value(w).astype(np.float64)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)


def test_symbolic_rows_take_the_widest_weight_panel_that_fits_the_panel_bytes():
    # BERT-base (n, k): FFN down's K = 3072 takes 6 blocks of 32 columns (1.18 MB of bf16), the output
    # projection all 24; int8 weights take half the bytes
    assert amx.panel_blocks(768, 3072) == 6
    assert amx.panel_blocks(768, 768) == 24
    assert amx.panel_blocks(3072, 768) == 24  # FFN up: 24 of its 96 blocks
    assert amx.panel_blocks(768, 3072, amx.INT8_TILES) == 12
    assert amx.panel_blocks(64, 10 ** 9) == 1  # one block when none fits


def test_shapes_off_the_tiles_are_left_to_the_next_rule():
    for lead, k, n in [((2, 8), 64, 64), ((32,), 48, 64), ((32,), 64, 48)]:
        assert amx.schedule_amx_gemm(gemm_func(lead, k, n).with_attr("global_symbol", "main")) is None


def test_sapphire_rapids_code_runs_the_contractions_on_tiles():
    compiled = _layer_bf16(SPR.target())
    on_tiles = scheduled_by(compiled.mod, amx.AmxContractions())
    # merged QKV, output, FFN up (+ GELU), FFN down; the attention's scores and context in one tile kernel of
    # their own (tests/schedules/test_amx_attention.py)
    assert len(on_tiles) == 4, compiled.kernels
    assert "tile_attention" in compiled.kernels and compiled.uses_amx
    asm = asm_of(compiled)
    counts = {op: asm.count(op) for op in TILE_OPS}
    assert counts["ldtilecfg"] == counts["tilerelease"] == 5 and counts["tdpbf16ps"] > 0, counts
    assert "vdpbf16ps" not in asm  # every bf16 contraction of this layer fills whole tiles
    for name in on_tiles:
        # the accumulators start at zero in the tiles: no zeros written to memory and loaded back; the weight
        # tiles of later K steps are prefetched
        body = "\n".join(function_asm(asm, f"{name}_compute_"))
        assert "tilezero" in body and "memset" not in body and "prefetcht1" in body, name
        script = compiled.mod[name].script()
        # the configuration is loaded inside the parallel body: each thread's tile state is its own
        parallel = script.index("T.parallel(")
        assert parallel < script.index("llvm.x86.ldtilecfg") < script.index("llvm.x86.tdpbf16ps"), name
        # the right operand is read packed: [..., N/16, K/2, 16, 2] bf16 bits (a weight's at load, K's and V's
        # per call for a training step's attention), B tiles 64 bytes a row
        assert re.search(r"\w+: T\.Buffer\(\((T\.int64\(\d+\), )+T\.int64\(16\), T\.int64\(2\)\), "
                         r"\"uint16\"\)", script), name
        assert "T.int64(64))" in script  # the B tiles' stride


def test_symbolic_batch_and_seq_run_on_tiles_too():
    compiled = tvmdm.compile(build_encoder_layer(LAYER), shapes={}, target=SPR.target(), precision="bf16",
                             tuning_logs=None)
    assert [s.shape for s in compiled.inputs] == [("batch", "seq", 96), ("batch", "seq")]
    assert len(scheduled_by(compiled.mod, amx.AmxContractions())) == 4
    asm = asm_of(compiled)
    # and the attention's one kernel (schedules.amx_attention)
    assert asm.count("ldtilecfg") == 5 and "tdpbf16ps" in asm and "vdpbf16ps" not in asm


@pytest.mark.parametrize("batch, seq", [(2, 16), (1, 7), (3, 45)])
def test_symbolic_module_on_tiles_matches_onnxruntime(monkeypatch, batch, seq):
    # the tile units where this host has them, else the same tiles emulated
    emulate = not amx_runtime.host_has_amx()
    monkeypatch.setattr(amx, "EMULATE", emulate)
    compiled = tvmdm.compile(build_encoder_layer(LAYER), shapes={}, precision="bf16", tuning_logs=None)
    assert len(scheduled_by(compiled.mod, amx.AmxContractions())) == 4 and compiled.uses_amx == (not emulate)
    inputs = tvmdm.random_inputs(compiled, batch=batch, seq=seq)
    inputs["attention_mask"][0, seq // 2:] = 0
    got, ref = compiled.run(inputs), compiled.reference(inputs)
    assert got[0].shape == (batch, seq, 96)
    err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))
    assert 0 < err <= BF16_MAX_REL_ERR


def test_other_kinds_warn_and_keep_their_bf16_path():
    for kind in ("zen4", "zen4-avx2"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = tvmdm.compile(build_encoder_layer(LAYER), shapes=SHAPES, target=BY_NAME[kind].target(),
                                     precision="bf16", tuning_logs=None)
        messages = [str(w.message) for w in caught]
        no_tiles = [m for m in messages if "no AMX-BF16" in m]
        # Zen 4: one warning (AVX512-BF16 instead); AVX2: only the warning that there is no bf16 dot product
        assert len(no_tiles) == (1 if kind == "zen4" else 0), messages
        assert not compiled.uses_amx and "tdpbf16ps" not in asm_of(compiled)


@pytest.mark.parametrize("fusion", ["paper", "tvm"])
def test_emulated_layer_matches_onnxruntime(emulated, fusion):
    host = make_target("llvm")
    compiled = _layer_bf16(host, fusion=fusion, tuning_logs=None)
    # stock fusion keeps the attention's batched matmuls (on tiles); the paper level gives it one tile kernel
    # where the target has AMX, else keeps its fp32 einsums
    assert len(scheduled_by(compiled.mod, amx.AmxContractions())) == (6 if fusion == "tvm" else 4)
    assert ("tile_attention" in compiled.kernels) == (fusion == "paper" and has_amx_bf16(host))
    assert not compiled.uses_amx  # emulated: no tile instruction, nothing to ask Linux for
    inputs = tvmdm.random_inputs(compiled, batch=2, seq=32)
    inputs["attention_mask"][1, 11:] = 0
    got, ref = compiled.run(inputs), compiled.reference(inputs)
    err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))
    assert 0 < err <= BF16_MAX_REL_ERR


def _host_without_amx() -> tvm.target.Target:
    spec = dict(make_target("llvm").export())
    spec["mattr"] = [f for f in spec.get("mattr", []) if not f.startswith("+amx")]
    return tvm.target.Target(spec)


def test_emulated_training_step_matches_the_step_without_tiles(monkeypatch):
    def step():
        return tvmdm.compile_train_step(build_encoder_layer(LAYER), loss="mse", batch=2, seq=32, tuning_logs=None,
                                        precision="bf16", fusion="tvm", target=_host_without_amx())

    plain = step()  # (the tile units' own rounding differs a little from the emulation's fp32 sums)
    monkeypatch.setattr(amx, "EMULATE", True)
    tiles = step()
    # forward, input gradients and the weight gradients X^T dY (K rows of the 32 token rows) on tiles
    assert len(scheduled_by(tiles.mod, amx.AmxContractions())) >= 10, tiles.kernels
    feeds = tvmdm.random_inputs(plain, batch=2, seq=32)
    batch = dict(feeds, labels=np.random.default_rng(1).standard_normal(plain.target_spec.shape).astype(np.float32))
    (loss, grads), (loss_tiles, grads_tiles) = plain.gradients(batch), tiles.gradients(batch)
    assert loss_tiles == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        scale = max(float(np.abs(grad).max()), 1e-6)
        assert float(np.abs(grads_tiles[name] - grad).max()) <= 1e-4 * scale, name


def test_tile_state_is_asked_for_before_the_first_call(tmp_path, monkeypatch):
    compiled = _layer_bf16(SPR.target())
    loaded = tvmdm.load(compiled.export(tmp_path / "amx.tvmdm"))
    assert loaded.uses_amx  # the artifact says so: a deployment process asks for the tile state too
    inputs = tvmdm.random_inputs(compiled, batch=2, seq=16)
    if not amx_runtime.host_has_amx():
        with pytest.raises(TvmdmError, match="runs its contractions on AMX tiles.*this CPU has no AMX"):
            loaded.run(inputs)  # an error, not a SIGILL
        return
    if SPR.cannot_run_here():
        pytest.skip(SPR.cannot_run_here())
    np.testing.assert_allclose(loaded.run(inputs)[0], compiled.reference(inputs)[0], atol=3e-2, rtol=3e-2)


def test_a_cpu_without_amx_is_told_so(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx avx2 avx512f avx512_bf16\n")
    monkeypatch.setenv("TVMDM_CPUINFO", str(cpuinfo))
    assert not amx_runtime.host_has_amx()
    amx_runtime.prepare(False)  # a module without tile kernels asks for nothing
    with pytest.raises(TvmdmError, match="compile it again on this machine"):
        amx_runtime.prepare(True)


def test_tile_state_request_where_the_host_has_amx():
    if not amx_runtime.host_has_amx():
        pytest.skip("this CPU has no AMX: Linux would refuse the tile state (tested where it has)")
    amx_runtime.request_tile_state()  # no error; asking twice is asking once
    amx_runtime.request_tile_state()


def test_int8_contractions_on_amx_int8_tiles_for_sapphire_rapids_and_emulated_here(monkeypatch):
    # a quantized model's contractions (schedules.int8) on tdpbusd where the shape fills whole tiles: u8
    # activation tiles of 64 bytes a row, int8 weights in vpdpbusd's packing [N/16, K/4, 16, 4], int32 tiles
    from tests.helpers.quantized import int8_matmul_model

    model, shapes = int8_matmul_model(128, 64), {"x": [2, 32, 128]}
    compiled = tvmdm.compile(model, shapes=shapes, target=SPR.target(), tuning_logs=None)
    asm = asm_of(compiled)
    assert compiled.uses_amx and asm.count("ldtilecfg") == asm.count("tilerelease") == 1
    assert "tdpbusd" in asm and "vpdpbusd" not in asm and "tdpbf16ps" not in asm
    (kernel,) = [k for k in compiled.kernels if "int8_gemm" in k]
    body = "\n".join(function_asm(asm, f"{kernel}_compute_"))
    assert "tilezero" in body and "memset" not in body
    script = compiled.mod[kernel].script()
    assert script.index("T.parallel(") < script.index("llvm.x86.ldtilecfg") < script.index("llvm.x86.tdpbusd")
    assert re.search(r"T\.Buffer\(\(T\.int64\(4\), T\.int64\(32\), T\.int64\(16\), T\.int64\(4\)\), \"int8\"\)",
                     script)
    # symbolic rows: the kernel that quantizes the activations writes them padded to whole 32-row blocks
    symbolic = tvmdm.compile(model, target=SPR.target(), tuning_logs=None)
    assert "tdpbusd" in asm_of(symbolic) and symbolic.uses_amx
    assert [k for k in symbolic.kernels if "quantize" in k and "pad_rows" in k], symbolic.kernels
    if not has_int8_dot(make_target("llvm")):
        pytest.skip("the emulated tiles read vpdpbusd's packing, which the rewrite picks only for a CPU with "
                    "AVX512-VNNI; this one has none")
    monkeypatch.setattr(amx, "EMULATE", True)
    emulated = tvmdm.compile(model, shapes=shapes, tuning_logs=None)
    assert not emulated.uses_amx and "b_tiles" in emulated.mod[kernel].script()  # the tiles, as loops
    x = {"x": np.random.default_rng(0).standard_normal((2, 32, 128)).astype(np.float32)}
    result = emulated.check(x, atol=1e-5, rtol=1e-5)
    assert result.ok, str(result)


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 33), (3, 64)])
def test_emulated_int8_tiles_of_symbolic_rows_match_numpy(batch, seq):
    # u8 activations padded to whole 32-row blocks (pad_rows_func) read in place by tdpbusd, the zero point's
    # column-sum term after; exact integers
    from tvmdm.transform.int8_kernels import VNNI, column_sums, int8_gemm_func
    from tvmdm.transform.kernels import pad_rows_func

    k, n = 128, 96
    lead = (tvm.tirx.Var("batch", "int64"), tvm.tirx.Var("seq", "int64"))
    func = int8_gemm_func(lead, k, n, VNNI, padded=True).with_attr("global_symbol", "main")
    scheduled = amx.schedule_amx_gemm(func, emulate=True, op=amx.INT8_TILES)
    assert scheduled is not None
    gemm = tvm.compile(tvm.IRModule({"main": scheduled}), target=make_target("llvm"))["main"]
    pad = tvm.compile(tvm.IRModule({"main": pad_rows_func(lead + (k,), "uint8").with_attr("global_symbol", "main")}),
                      target=make_target("llvm"))["main"]
    rng = np.random.default_rng(seq)
    x = rng.integers(0, 256, (batch, seq, k)).astype(np.uint8)
    w = rng.integers(-128, 128, (k, n)).astype(np.int8)
    zero_point = np.uint8(117)
    padded = tvm.runtime.tensor(np.zeros((batch, -(-seq // TILE_ROW_PAD) * TILE_ROW_PAD, k), np.uint8))
    pad(tvm.runtime.tensor(x), padded)
    assert (padded.numpy()[:, seq:] == x[:, -1:]).all()  # the rows past the end: copies of the last
    out = tvm.runtime.tensor(np.zeros((batch, seq, n), np.int32))
    gemm(padded, tvm.runtime.tensor(zero_point), tvm.runtime.tensor(VNNI.pack(w)),
         tvm.runtime.tensor(column_sums(w)), out)
    np.testing.assert_array_equal(out.numpy(), (x.astype(np.int64) - zero_point) @ w.astype(np.int64))
