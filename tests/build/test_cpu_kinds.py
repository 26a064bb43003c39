"""Every CPU-dependent branch on every CPU kind, whatever machine runs the suite (tests/cpu_kinds.py): the register
tiles (AVX-512 8 x 3 vectors, AVX2 4 x 3), the SM and row schedules, packed vs logged contractions, the bf16 dot
product, checked in the schedules and the generated code of a build for each kind; the compiled layer is run
against onnxruntime where this machine can run that kind's code."""
import re
import warnings

import numpy as np
import pytest

import tvm

import tvmdm
from tests.helpers.cpu_kinds import KINDS, asm_of
from tests.helpers.quantized import int8_matmul_model, int8_matmul_reference
from schedules.logs import shipped_logs
from schedules.bf16 import has_bf16_dot
from schedules.int8 import has_int8_dot
from schedules.database import TuningLogWarning
from tvmdm.build.options import packed_lanes
from tvmdm.models import BertConfig, build_encoder_layer
from tvmdm.core.precision import BF16_MAX_REL_ERR
from tvmdm.core.target import features_missing_here, llvm_target, vector_lanes

# Contraction dims whole panels for both widths (AVX2: 24 columns, AVX-512: 48); 16 keys: whole key vectors
# for both, and 8 lanes' rows of exactly two vectors.
LAYER = BertConfig(hidden=96, heads=2, ffn=192, batch=2, seq=16)
SHAPES = {"hidden_states": [2, 16, 96], "attention_mask": [2, 16]}
ROW_KERNELS = {"bdrln"}  # the paper's bias + residual + LayerNorm, twice in the layer: one kernel
_BUILT: dict = {}


@pytest.fixture(params=KINDS, ids=[k.name for k in KINDS])
def kind(request):
    return request.param


def _compiled(kind, precision="fp32"):
    key = (kind.name, precision)
    if key not in _BUILT:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the logs' and bf16's warnings: asserted in their own tests
            _BUILT[key] = tvmdm.compile(build_encoder_layer(LAYER), shapes=SHAPES, target=kind.target(),
                                        precision=precision)
    return _BUILT[key]


def _register_tiles(script: str) -> list[tuple[int, ...]]:
    """The micro-kernels' accumulator tiles (rows, vectors, lanes), in order: the extents of the unrolled and
    vectorized loops right inside each serial loop (a reduction, or a copy's rows) that has any."""
    lines = script.splitlines()
    tiles = []
    for i, line in enumerate(lines):
        if not re.search(r"for \w+ in range\(", line):
            continue
        tile = []
        for inner in lines[i + 1:]:
            found = re.search(r"in T\.(unroll|vectorized)\(T\.int64\((\d+)\)\)", inner)
            if not found:
                break
            tile.append(int(found.group(2)))
        if tile:
            tiles.append(tuple(tile))
    return tiles


def _register_tile(script: str) -> tuple[int, ...]:
    """The first of _register_tiles."""
    return next(iter(_register_tiles(script)), ())


def test_target_of_each_kind(kind):
    target = kind.target()
    assert vector_lanes(target) == kind.lanes
    assert has_bf16_dot(target) == kind.bf16_dot
    assert has_int8_dot(target) == kind.int8_dot
    logs = shipped_logs(target)
    assert bool(logs) == kind.logs_apply
    # packed fp32 contractions where no shipped log was tuned on this CPU model, panels of 3 vectors; on the
    # model it was tuned on, wherever the size differs from the records' (8 x 128 rows)
    assert packed_lanes(logs, target, "fp32", rows=8 * 128) == (3 * kind.lanes if kind.packed else None)
    assert packed_lanes(logs, target, "fp32", rows=128) == 3 * kind.lanes


def test_shipped_logs_tuned_wider_are_named_in_a_warning(kind):
    import schedules.logs

    schedules.logs._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shipped_logs(kind.target())
    named = [str(w.message) for w in caught if issubclass(w.category, TuningLogWarning)]
    if kind.logs_apply:
        assert not named
    else:
        assert len(named) == 1 and f"({32 * kind.lanes}-bit): not applied" in named[0], named


def test_schedules_and_code_of_each_kind(kind):
    compiled = _compiled(kind)
    # the paper's attention (static inference: SM and the context as one kernel, transform.attention_kernel) and
    # row normalizations by hand on every kind (no record fits this shape)
    assert {"attention"} | ROW_KERNELS <= set(compiled.hand_kernels), compiled.hand_kernels
    rows = 8 if kind.lanes == 16 else 4  # accumulators: 8 x 2 vectors of AVX-512's 32 registers, 4 x 2 of 16
    key_vectors = 16 // kind.lanes  # 16 keys: one vector of 16 lanes, two of 8
    assert (rows, key_vectors, kind.lanes) in _register_tiles(compiled.mod["attention"].script())
    # every kind packs this layer's contractions: no shipped record is of its size (the Zen 4 records are for
    # (8, 128) at BERT-base widths; test_target_of_each_kind checks which kinds use them there)
    gemms = [k for k in compiled.kernels if "packed_gemm" in k]
    assert compiled.options.packed_lanes == 3 * kind.lanes  # merged QKV, output, FFN up and down:
    assert len(gemms) == 4 and set(gemms) <= set(compiled.hand_kernels), compiled.kernels
    for name in gemms:  # 8 x 3 accumulator vectors on AVX-512, 4 x 3 on AVX2's 16 registers
        assert _register_tile(compiled.mod[name].script()) == (rows, 3, kind.lanes), name
    asm = asm_of(compiled)
    assert ("zmm" in asm) == (kind.lanes == 16)  # AVX2 code must not touch a 512-bit register
    assert "ymm" in asm


def test_sm_rows_of_exactly_one_vector_get_the_hand_schedule(kind, tiny_layer):
    # 8 keys on AVX2's 8 lanes: the softmax partials have no step loop; the rule once raised there and SM fell
    # back to the default schedule (4 parallel loops instead of one task per (batch, head))
    compiled = tvmdm.compile(tiny_layer, shapes={"hidden_states": [2, 8, 32], "attention_mask": [2, 8]},
                             target=kind.target(), tuning_logs=None)
    # (static: SM and the context as one kernel, transform.attention_kernel)
    parallel = [line for line in compiled.mod["attention"].script().splitlines() if "T.parallel" in line]
    assert "attention" in compiled.hand_kernels and len(parallel) == 1, parallel


def test_bf16_code_of_each_kind(kind):
    # without the dot product: a warning and a generic schedule computing the same numbers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = tvmdm.compile(build_encoder_layer(LAYER), shapes=SHAPES, target=kind.target(), precision="bf16")
    _BUILT[(kind.name, "bf16")] = compiled
    assert any("no AVX512-BF16" in str(w.message) for w in caught) != kind.bf16_dot
    asm = asm_of(compiled)
    # with AMX the weight contractions are on the tiles and the paper level keeps the attention batched matmuls,
    # which in this layer (heads of 48) fill no whole tiles: vdpbf16ps (without AMX the attention stays fp32)
    assert ("vdpbf16ps" in asm) == kind.bf16_dot
    assert ("tdpbf16ps" in asm) == kind.amx
    assert any("no AMX-BF16" in str(w.message) for w in caught) == (kind.bf16_dot and not kind.amx)


def test_int8_code_of_each_kind_and_its_numbers_where_this_machine_can_run_it(kind):
    # a quantized model's contractions on vpdpbusd where the kind has AVX512-VNNI, else on AVX2 (with a warning)
    model = int8_matmul_model(64, 48)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = tvmdm.compile(model, shapes={"x": [2, 16, 64]}, target=kind.target(), tuning_logs=None)
    assert any("no VNNI" in str(w.message) for w in caught) != kind.int8_dot
    assert [k for k in compiled.hand_kernels if "int8_gemm" in k]
    asm = asm_of(compiled)
    # AVX2: vpmaddubsw, K reordered so that it cannot saturate (the model's weights allow it)
    assert ("vpdpbusd" in asm) == kind.int8_dot and ("vpmaddubsw" in asm) != kind.int8_dot
    reason = kind.cannot_run_here()
    if reason:
        pytest.skip(reason)
    x = {"x": np.random.default_rng(0).standard_normal((2, 16, 64)).astype(np.float32)}
    result = compiled.check(x, atol=1e-5, rtol=1e-5)
    assert result.ok, str(result)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_kind_runs_and_matches_onnxruntime_where_this_machine_can(kind, precision):
    reason = kind.cannot_run_here()
    if reason:
        pytest.skip(reason)
    compiled = _compiled(kind, precision)
    inputs = tvmdm.random_inputs(compiled, batch=2, seq=16)
    inputs["attention_mask"][1, 11:] = 0  # padded keys reach SM's softmax
    result = compiled.check(inputs)
    if precision == "fp32":
        assert result.ok, str(result)
    else:
        assert max(o.max_rel_err for o in result.outputs) <= BF16_MAX_REL_ERR, str(result)


def test_int8_on_avx_vnni_takes_vpdpbusd_on_256_bit_registers_in_the_stored_order():
    # Alder Lake and later client CPUs: VNNI without AVX-512 (none of our kinds; built from LLVM's model alone)
    target = tvm.target.Target(llvm_target("alderlake", None, **{"num-cores": 2}))
    weight = np.random.default_rng(0).integers(-127, 128, (64, 48)).astype(np.int8)  # pairs that saturate vpmaddubsw
    model = int8_matmul_model(64, 48, weight=weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = tvmdm.compile(model, shapes={"x": [2, 16, 64]}, target=target, tuning_logs=None)
    assert not any("no VNNI" in str(w.message) for w in caught)
    asm = asm_of(compiled)
    assert re.search(r"vpdpbusd\s+%ymm", asm) and "zmm" not in asm and "vpmaddubsw" not in asm
    assert not any("reorder_k" in k for k in compiled.kernels)  # vpdpbusd cannot saturate: no K order needed
    missing = features_missing_here(target)
    if missing:
        pytest.skip(f"this machine lacks {', '.join(missing)}, which code built for an AVX-VNNI CPU may use")
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32) * 3
    np.testing.assert_allclose(compiled.run({"x": x})[0], int8_matmul_reference(model, x), rtol=1e-5, atol=1e-3)
