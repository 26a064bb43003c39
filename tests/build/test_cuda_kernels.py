"""What the CUDA build of the base layer generates, read without a GPU: every fp16 contraction (the attention's
included) on tensor cores, grids that fill an H100, coalesced operand loads, no register spills (ptxas)."""
import os
import re
import shutil
import subprocess

import pytest

import tvmdm
from schedules.tensor_cores import TILES, pick_tile
from tests.helpers.cuda import cuda_source, kernel_sources, launch_extents
from tvmdm import models
from tvmdm.build.shapes import resolve_shapes
from tvmdm.core.target import CUDA_MULTIPROCESSORS

H100_SMS = CUDA_MULTIPROCESSORS["sm_90"]


@pytest.fixture(scope="module")
def layer_fp16():
    shapes = resolve_shapes("bert-base-layer", None, 8, 128)
    return tvmdm.compile(models.default_model("bert-base-layer"), target="cuda:sm_90", shapes=shapes,
                         precision="fp16")


def _contractions(compiled) -> list[str]:
    return [k for k, ops in compiled.kernel_ops.items() if "matmul" in ops or "einsum" in ops]


def test_every_fp16_contraction_runs_on_tensor_cores(layer_fp16):
    kernels = kernel_sources(cuda_source(layer_fp16))
    contractions = _contractions(layer_fp16)
    # QKV, scores, context, output projection, FFN1, FFN2
    assert len(contractions) == 6, layer_fp16.kernel_ops
    for name in contractions:
        bodies = [body for k, body in kernels.items() if k == f"{name}_kernel" or k.startswith(f"{name}_kernel_")]
        assert bodies, (name, sorted(kernels))
        assert any("wmma::mma_sync" in body for body in bodies), name
    others = [k for k in layer_fp16.kernels if k not in contractions]
    assert not any("mma_sync" in body for k, body in kernels.items() if k.rsplit("_kernel", 1)[0] in others)


def test_contraction_grids_fill_the_gpu(layer_fp16):
    for name in _contractions(layer_fp16):
        extents = launch_extents(layer_fp16.mod[name])
        blocks = extents.get("blockIdx.x", 1) * extents.get("blockIdx.y", 1) * extents.get("blockIdx.z", 1)
        assert blocks >= H100_SMS, (name, extents)  # dlight's 128 x 128 tile gave 48 for N=768
        assert extents["threadIdx.x"] == 32 and extents["threadIdx.y"] in (4, 8, 16), (name, extents)


def test_operands_reach_shared_memory_in_16_byte_loads(layer_fp16):
    kernels = kernel_sources(cuda_source(layer_fp16))
    for name in _contractions(layer_fp16):
        body = kernels[f"{name}_kernel"]
        # both operands' global reads are uint4 (8 halves, 16 bytes): along K for activations, along N for the
        # weights ([K, N] in ONNX) and V, never 2-byte loads down a column
        read_wide = set(re.findall(r"= \*\(uint4\*\)\((\w+_ptr) \+", body))
        assert len(read_wide) == 2, (name, read_wide)


def test_tile_choice():
    by_shape = {(1, 1024, 768): (64, 64), (1, 1024, 2304): (128, 128), (1, 1024, 3072): (128, 128),
                (96, 128, 128): (128, 64), (96, 128, 64): (64, 64)}
    for (batch, rows, cols), want in by_shape.items():
        tile = pick_tile(batch, rows, cols, 768, H100_SMS)
        assert (tile.rows, tile.cols) == want, (batch, rows, cols, tile)
        assert batch * (rows // tile.rows) * (cols // tile.cols) >= H100_SMS
    small = pick_tile(1, 128, 768, 768, H100_SMS)  # (1, 128): no tile reaches 132 blocks: the most blocks
    assert (small.rows, small.cols) == (TILES[-1].rows, TILES[-1].cols)
    assert pick_tile(1, 1024, 768, 768, 48).rows == 128  # fewer SMs: bigger tiles suffice
    assert [pick_tile(1, 1024, 768, k, H100_SMS).frags_k for k in (768, 96, 48)] == [4, 2, 1]
    # no tile divides 32 rows, nor a reduction of 24: dlight's rules take those
    assert pick_tile(1, 32, 768, 768, H100_SMS) is None and pick_tile(1, 1024, 768, 24, H100_SMS) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: ptxas cannot be asked")
def test_ptxas_reports_no_spills(layer_fp16, tmp_path):
    source = tmp_path / "layer.cu"
    source.write_text(cuda_source(layer_fp16))
    done = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-w", "-Xptxas", "-v", "-o", os.devnull, str(source)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # per kernel: "Function properties for K" then "N bytes stack frame, N bytes spill stores, N bytes spill loads"
    frames = re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                        r"(\d+) bytes spill loads", done.stderr)
    assert {k for k, *_ in frames} == set(kernel_sources(cuda_source(layer_fp16))), done.stderr[-2000:]
    assert [k for k, *sizes in frames if any(int(n) for n in sizes)] == []  # no local memory at all


def test_analyze_counts_the_tensor_core_contractions(layer_fp16):
    # 2MNK of every contraction, though tensorization hides the arithmetic in intrinsic calls
    report = tvmdm.analyze(layer_fp16)
    contraction = report.totals()["tensor contraction"]
    b, s, h, ffn, heads = 8, 128, 768, 3072, 12
    weights = 2 * b * s * h * (3 * h + h + 2 * ffn)
    attention = 2 * 2 * b * heads * s * s * (h // heads)
    # (their epilogues' bias, GELU and mask arithmetic add 1.7 %)
    assert weights + attention <= contraction["flops"] <= 1.02 * (weights + attention), contraction
    assert contraction["kernels"] == 6
