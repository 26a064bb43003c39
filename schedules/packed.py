"""fp32 contractions on packed weights, scheduled by hand on CPUs that have no tuned records.

tvmdm.transform.precision.packed_fp32_contractions stores each weight as panels of PANEL_VECTORS vectors' worth of
columns, contiguous over K ([N/lanes, K, lanes, 1], packed once at load). The micro-kernel keeps rows x
PANEL_VECTORS vector accumulators in registers (ROWS by vector width: 4 x 3 fits AVX2's 16 registers, 8 x 3
AVX-512's 32); each k loads one panel row (PANEL_VECTORS vectors, contiguous) and broadcasts the rows'
activations. A parallel task is one
panel against the rows of one leading index (for a [B, S, K] input: S rows), so the panel stays in L1/L2
while the rows stream. Fused epilogues (bias, GELU, residual) run per tile from the accumulators.

Measured on 2 Zen 4 cores without AVX-512 (AVX2, 8 lanes): [1024, 768] x [768, 3072] 147 GFLOP/s,
[1024, 3072] x [3072, 768] 144, 768 x 768 137 (numpy's GEMM: 138); the same contractions on the unpacked
weight with the same micro-kernel: 50-68 GFLOP/s (a weight row apart per k: one page per k for N=3072).
On 2 Sapphire Rapids cores (AVX-512), 8 rows instead of 4 halve the panel bytes read from L2 per FMA: the FFN
contractions 353 and 359 GFLOP/s against 312 and 299 with 4 rows, 768 x 768 345 against 286 (numpy's GEMM: 343).
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import Schedule

from schedules.rule import DOES_NOT_FIT, ScheduleRule
from schedules.default import inline_elementwise, tile_dividing
from schedules.transposes import tile_transpose
from tvmdm.transform.kernels import FP32_GEMM_BLOCK, FP32_PACK_BLOCK as PACK_BLOCK, TRANSPOSED_ROWS_BLOCK
from tvmdm.core.target import vector_lanes

# rows per register tile, by vector lanes (AVX-512: 8 x 3 accumulators of 32 registers); each divides
# precision.ROW_PAD, the tile symbolic rows are padded to
ROWS = {16: 8, 8: 4}
PANEL_VECTORS = 3
TILE = 8  # rows per tile of the transposing copies


def panel_lanes(target: tvm.target.Target) -> int:
    """Columns per packed weight panel on ``target``."""
    return PANEL_VECTORS * vector_lanes(target)


def epilogue_into_tile(sch, acc, at, lanes: int) -> None:
    """Compute the epilogue straight from the accumulators, per tile (under loop ``at``), vectorized."""
    target = acc
    for consumer in sch.get_consumers(acc):
        try:
            sch.reverse_compute_inline(consumer)
        except Exception:  # noqa: BLE001 - not inlinable: it runs per tile after the write-back
            sch.reverse_compute_at(consumer, at)
            target = consumer
    for block in {acc, target}:
        inner = sch.get_loops(block)[-1]
        if sch.get(inner).kind != tirx.ForKind.VECTORIZED and int(sch.get(inner).extent) % lanes == 0:
            _, vector = sch.split(inner, [None, lanes])
            sch.vectorize(vector)


def schedule_packed_gemm(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc:
    """The micro-kernel schedule for a kernel holding a ``packed_gemm`` block (and fused epilogues); ``lanes``:
    fp32 values per vector register."""
    sch = Schedule(func)
    inline_elementwise(sch, sch.get_sblock("root"))
    gemm = sch.get_sblock(FP32_GEMM_BLOCK)
    *outer, m, n, k = sch.get_loops(gemm)
    static_rows = isinstance(sch.get(m).extent, tirx.IntImm)
    # symbolic rows: gemm_func padded them to whole tiles of ROW_PAD, which ROWS divides
    rows = tile_dividing(sch.get(m).extent, (ROWS.get(lanes, 4), 4, 2, 1)) if static_rows else ROWS.get(lanes, 4)
    mo, mi = sch.split(m, [None, rows])
    no, nv, ni = sch.split(n, [None, PANEL_VECTORS, lanes])
    sch.reorder(no, *outer, mo, k, mi, nv, ni)
    sch.parallel(sch.fuse(no, *outer) if outer else no)
    if static_rows:
        acc = sch.cache_write(gemm, 0, "local")
        sch.reverse_compute_at(acc, mo)
    else:  # symbolic rows: gemm_func's whole tiles are already an intermediate, copied out per tile (guarded)
        acc = gemm
        sch.set_scope(gemm, 0, "local")
    sch.unroll(mi)
    sch.unroll(nv)
    sch.vectorize(ni)  # before decompose_reduction: vectorize refuses an update block without its init
    init = sch.decompose_reduction(gemm, k)
    sch.vectorize(sch.get_loops(init)[-1])
    epilogue_into_tile(sch, acc, mo, lanes)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _reads_along(block, var) -> bool:
    """Whether the last index of every read of ``block`` depends on ``var`` (the reads are contiguous along it;
    a concatenation reads one of several)."""
    return all(any(v.same_as(var) for v in tirx.analysis.undefined_vars(read.region[-1].min))
               for read in block.reads)


def schedule_weight_pack(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The weight (or dY) packing [N/lanes, K, lanes, 1]: panels in parallel; a plain weight is copied a panel
    row at a time (vectorized), a transposed one in tiles of TILE x lanes (reads and writes within L1). A training
    step packs every weight each step: [768, 3072] 0.6 ms against 8.7 ms on the default schedule, transposed 0.3
    against 3.5 ms."""
    sch = Schedule(func)
    block = sch.get_sblock(PACK_BLOCK)
    sources = 1
    for producer in sch.get_producers(block):  # a reshape fused in front (dY's [B, S, N] -> [B*S, N])
        if sch.get(producer).name_hint.startswith("T_concat"):  # merged QKV: training packs it each step
            sources = len(sch.get(producer).reads)
        sch.compute_inline(producer)
    *_, no, ko, ni, _pair = sch.get_loops(block)
    if sources > 1 and int(sch.get(no).extent) % sources == 0:
        # A panel per source at a time: the source loop unrolled, each copy's concat condition is constant and
        # simplifies away ([768, 3 x 768]: 0.27 ms against 2.1 with a select per element; 0.74 against 3.8 from DRAM)
        source, no = sch.split(no, [sources, None])
        sch.unroll(source)
    sch.parallel(no)
    if _reads_along(sch.get(block), sch.get(block).iter_vars[-2].var):
        sch.vectorize(ni)
    else:
        koo, koi = sch.split(ko, [None, TILE])
        sch.reorder(koo, ni, koi)
        sch.unroll(koi)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


PAIR_ROWS = 8  # k pairs per step of the bf16 packing


def schedule_pair_pack(func: tirx.PrimFunc, block_name: str) -> tirx.PrimFunc:
    """The bf16 packing [N/16, K/2, 16, 2] of a weight or of dY (a training step packs them every step). A
    plain source (read along N): in parallel over steps of PAIR_ROWS k pairs, each step copying its source
    rows into every panel (the rows are read once, contiguously; a panel a task read a 64-byte piece of each
    row, a page apart). A transposed one: in parallel over panels, each step 16 source rows of 2 x PAIR_ROWS
    values. [3072, 768] weight from DRAM (2 Sapphire Rapids cores): plain 0.78 ms against 1.22 with a tuned
    record, transposed 0.71 against 0.87; [768, 768] 0.32 against 0.40."""
    sch = Schedule(func)
    block = sch.get_sblock(block_name)
    sources = 1
    for producer in sch.get_producers(block):  # a reshape (dY) or the merged QKV's concatenation in front
        if sch.get(producer).name_hint.startswith("T_concat"):
            sources = len(sch.get(producer).reads)
        sch.compute_inline(producer)
    *lead, no, ko, ni, pair = sch.get_loops(block)
    step = next(f for f in (PAIR_ROWS, 4, 2, 1) if int(sch.get(ko).extent) % f == 0)
    ko, ki = sch.split(ko, [None, step])
    if _reads_along(sch.get(block), sch.get(block).iter_vars[-2].var):
        panels = [no]
        if sources > 1 and int(sch.get(no).extent) % sources == 0:  # each source's condition constant
            source, no = sch.split(no, [sources, None])
            sch.unroll(source)
            panels = [source, no]
        sch.reorder(*lead, ko, *panels, ki, ni, pair)
        sch.parallel(sch.fuse(*lead, ko) if lead else ko)
    else:
        sch.reorder(*lead, no, ko, ni, ki, pair)
        sch.parallel(sch.fuse(*lead, no) if lead else no)
        sch.unroll(ki)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_tiled_transpose(func: tirx.PrimFunc, block_name: str, tile: int = TILE) -> tirx.PrimFunc:
    """X^T for a weight gradient (X [B*S, K], element-wise producers such as a reshape inlined; bf16's
    transposing conversion too): square tiles in parallel, each within L1."""
    sch = Schedule(func)
    block = sch.get_sblock(block_name)
    for producer in sch.get_producers(block):
        sch.compute_inline(producer)
    sch.unroll(tile_transpose(sch, block, tile))
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


class PackedContractions(ScheduleRule):
    """The packed fp32 contractions' kernels (the contraction, the weight packing, the transposed X), on CPUs."""

    name = "packed contractions"

    def schedule(self, func, options):
        if not options.on_cpu:
            return None
        lanes = vector_lanes(options.target)
        rules = ((FP32_GEMM_BLOCK, lambda f: schedule_packed_gemm(f, lanes)), (PACK_BLOCK, schedule_weight_pack),
                 (TRANSPOSED_ROWS_BLOCK, lambda f: schedule_tiled_transpose(f, TRANSPOSED_ROWS_BLOCK)))
        sch = Schedule(func)  # one lookup per kernel for all three block names
        for block, rule in rules:
            try:
                sch.get_sblock(block)
            except DOES_NOT_FIT:  # get_sblock raises when there is no such block
                continue
            return rule(func)
        return None
