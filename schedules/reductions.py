"""Column reductions: C[n] = sum over rows of A[rows..., n] (a training step's bias gradients, LayerNorm's scale
and bias gradients). Their rows are the reduction and their output is the innermost, contiguous axis, so the
default rule (parallel over n, the rows serial inside) reads A a column at a time, and MetaSchedule's CPU
space finds nothing better (5.8 ms for a [1024, 3072] bias gradient after 32 trials, 0.5 GFLOP/s). Here: n in
strips of STRIP columns, parallel over the strips, the rows inside, and the strip's columns innermost
(accumulated in vector registers, A read a row segment at a time): ~0.5 ms for the same kernel. BSB (LayerNorm's
scale and bias gradients) first recomputes each row's statistics: those as in schedules.rows, a pass over
tiles of rows each, then the column sums (base layer, Sapphire Rapids VM: 0.24 ms against 1.20 ms without it).
Scheduled before the logs apply (their records of these kernels are worse) and left out of tuning."""
from __future__ import annotations

from tvm import tirx
from tvm.s_tir import schedule as sch_mod

from schedules.rule import ScheduleRule, finds_block
from schedules.default import inline_elementwise
from schedules.rows import is_row_reduction, reductions_in_row_tiles

STRIP = 64  # columns per strip: four 16-lane vectors of fp32 accumulators
LANES = 16


def _column_reduction_block(sch):
    """(the kernel's column reduction block, the row reductions before it) after inlining its element-wise
    producers, when its last block sums rows into a 1-D output whose length is a multiple of LANES and any
    block before it reduces each of those rows (BSB: the row statistics of the LayerNorm it differentiates);
    else None."""
    root = sch.get_sblock("root")
    names = inline_elementwise(sch, root)
    block = sch.get_sblock(names[-1])
    iter_vars = sch.get(block).iter_vars
    spatial = [iv for iv in iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    reduce = [iv for iv in iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    loops = sch.get_loops(block)
    if len(spatial) != 1 or not reduce or len(loops) != len(iter_vars) or \
            iter_vars[0].iter_type != tirx.IterVar.DataPar:
        return None
    extent = spatial[0].dom.extent
    if not isinstance(extent, tirx.IntImm) or extent.value % LANES:
        return None
    for name in names[:-1]:
        row_block = sch.get(sch.get_sblock(name))
        width = row_block.iter_vars[-1].dom.extent
        if not isinstance(width, tirx.IntImm) or width.value % LANES \
                or not is_row_reduction(row_block, len(reduce), width.value):
            return None
    return block, names[:-1]


def is_column_reduction(func: tirx.PrimFunc) -> bool:
    return finds_block(func, _column_reduction_block)


def schedule_column_reduction(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    sch = sch_mod.Schedule(func)
    found = _column_reduction_block(sch)
    if found is None:
        return None
    block, row_reductions = found
    for name in row_reductions:  # the row statistics first, each a pass over tiles of rows (the column
        reductions_in_row_tiles(sch, [name], name, LANES, alone=True)  # block reads them: no compute_at)
    col, *rows = sch.get_loops(block)
    n = int(sch.get(col).extent)
    strip = STRIP if n % STRIP == 0 else LANES
    strips, within = sch.split(col, [None, strip])
    sch.reorder(strips, *rows, within)
    sch.parallel(strips)
    init = sch.decompose_reduction(block, rows[0])
    sch.vectorize(sch.get_loops(init)[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


class ColumnReductions(ScheduleRule):
    """Column reductions (a bias gradient: the sum over rows), by hand on CPUs."""

    name = "column reductions"

    def schedule(self, func, options):
        return schedule_column_reduction(func) if options.on_cpu else None
