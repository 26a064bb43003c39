"""Row-wise normalizations (LayerNorm, BDRLN, softmax, LayerNorm's input gradient BLNRD) scheduled by hand.

Such a kernel is a few reductions over the last axis of each row (sums, squared deviations, maxima), then one
element-wise block writing the row, every block indexed by the same leading axes. The default rule and the
Zen 4 records run each reduction over all rows before the next starts (each pass reads the inputs from
memory again) and reduce a row serially (one add per cycle). Here a parallel task is a tile of rows: every
reduction of a row runs while its inputs are in L1, as ``lanes`` partial results side by side (rfactor,
vectorized) combined at the row's end, and the output is written a vector at a time.
Sapphire Rapids VM, 2 cores, base layer (B=8, S=128): BDRLN 0.65 ms (Zen 4 record; default rule 1.34) -> 0.18,
LayerNorm 0.19 -> 0.13, BLNRD 1.02 -> 0.21, BS 0.58 -> 0.33; softmax as fast as its record (0.56).
"""
from __future__ import annotations

from tvm import tirx
from tvm.s_tir import Schedule

from schedules.rule import DOES_NOT_FIT, ScheduleRule, log
from tvmdm.core.target import vector_lanes
from tvmdm.transform.row_reductions import EXTREMA
from tvmdm.transform.ir import has_block
from tvmdm.transform.kernels import LANES
from tvmdm.transform.stats_into_producers import PARTIALS
from schedules.default import inline_elementwise, tile_dividing

ROW_TILE = 4  # rows per task: a few KB of each input, in L1 across the reductions


def _unit(iter_var) -> bool:
    return iter_var.iter_type == tirx.IterVar.DataPar and isinstance(iter_var.dom.extent, tirx.IntImm) \
        and iter_var.dom.extent.value == 1


def is_row_reduction(block: tirx.SBlock, leading: int, width: int) -> bool:
    """Whether ``block`` reduces the last axis (``width`` long) of each of ``leading`` spatial axes (then maybe a
    kept axis of 1)."""
    iter_vars = list(block.iter_vars)
    if len(iter_vars) == leading + 2 and _unit(iter_vars[-2]):  # a kept dim: [rows..., 1]
        iter_vars = [*iter_vars[:-2], iter_vars[-1]]
    kinds = [iv.iter_type for iv in iter_vars]
    extent = iter_vars[-1].dom.extent
    return kinds == [tirx.IterVar.DataPar] * leading + [tirx.IterVar.CommReduce] \
        and isinstance(extent, tirx.IntImm) and extent.value == width


def _row_blocks(sch, lanes: int) -> list[str] | None:
    """The block names when the kernel is a row-wise normalization over a last axis that ``lanes`` divides:
    reductions over the last axis alone (the output's leading axes, maybe a kept axis of 1), then one
    element-wise block; else None."""
    names = [n for n in inline_elementwise(sch, sch.get_sblock("root")) if n != PARTIALS]
    if len(names) < 2:
        return None
    last = sch.get(sch.get_sblock(names[-1]))
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in last.iter_vars) or len(last.iter_vars) < 2:
        return None
    extent = last.iter_vars[-1].dom.extent
    if not isinstance(extent, tirx.IntImm) or extent.value % lanes:
        return None
    for name in names[:-1]:
        block = sch.get_sblock(name)
        if not is_row_reduction(sch.get(block), len(last.iter_vars) - 1, extent.value) \
                or len(sch.get_loops(block)) != len(sch.get(block).iter_vars):
            return None
    return names


def reductions_in_row_tiles(sch, reductions: list[str], anchor: str, lanes: int, alone: bool = False):
    """Each of ``reductions`` as ``lanes`` partials (name_rf, vectorized) and their sum (name); the rows of block
    ``anchor`` (all its loops but the last) in parallel tiles, every block before it computed per tile
    (``alone``: only the anchor's partials, the anchor being one of ``reductions`` whose other consumers do not
    run per row). Returns the anchor's last loop."""
    for name in reductions:
        block = sch.get_sblock(name)
        _, lane = sch.split(sch.get_loops(block)[-1], [None, lanes])
        sch.rfactor(lane, factor_axis=len(sch.get(block).iter_vars) - 1)
    *leading, last = sch.get_loops(sch.get_sblock(anchor))
    rows = sch.fuse(*leading) if len(leading) > 1 else leading[0]
    tile = tile_dividing(sch.get(rows).extent, (ROW_TILE, 2, 1))
    task, row = sch.split(rows, [None, tile])
    sch.parallel(task)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    before = [anchor + "_rf"] if alone else names[:names.index(anchor)]
    for name in reversed(before):
        sch.compute_at(sch.get_sblock(name), row)
    depth = len(sch.get_loops(sch.get_sblock(anchor))) - 1  # the loops down to ``row``
    for name in before:
        if name.endswith("_rf"):  # partials: (lane, [kept 1], step) -> (step, lane), the lanes vectorized
            block = sch.get_sblock(name)
            inner = sch.get_loops(block)[depth:]
            lane = next(loop for loop in inner if int(sch.get(loop).extent) == lanes)
            sch.reorder(inner[-1], lane)
            sch.vectorize(lane)
    return last


def schedule_row_normalization(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The schedule above, or None when ``func`` is not a row-wise normalization."""
    sch = Schedule(func)
    names = _row_blocks(sch, lanes)
    if names is None:
        return None
    column = reductions_in_row_tiles(sch, names[:-1], names[-1], lanes)
    row = sch.get_loops(sch.get_sblock(names[-1]))[-2]
    sch.vectorize(sch.split(column, [None, lanes])[1])
    place_partials(sch, row)  # a quantized model's next quantization statistics, each row after it is written
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_row_reduction(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """A kernel that only reduces the last axis of each row (a max or min per row: tvmdm.transform.
    row_reductions), as the reductions above: tiles of rows in parallel, ``lanes`` partials per row; None for
    any other kernel. 2 Zen 4 cores, the max of each row of [8, 128, 3072]: 4.4 ms on the default rule (a
    column at a time), 0.1 ms here."""
    sch = Schedule(func)
    names = inline_elementwise(sch, sch.get_sblock("root"))
    if len(names) != 1:
        return None
    block = sch.get(sch.get_sblock(names[0]))
    width = block.iter_vars[-1].dom.extent
    leading = len(block.iter_vars) - 1
    # one input, reduced along its last axis (a contraction reads two: not this rule's)
    if leading < 1 or len(block.reads) != 1 or len(block.reads[0].region) != leading + 1 or \
            not isinstance(width, tirx.IntImm) or width.value % lanes or \
            not is_row_reduction(block, leading, width.value):
        return None
    reductions_in_row_tiles(sch, names, names[0], lanes, alone=True)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_row_extrema(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """tvmdm.transform.row_reductions' max and min of each row (then the block writing both) as the
    normalizations above: both reductions of a row while it is in L1; None for any other kernel. 2 Sapphire
    Rapids cores, [8, 128, 3072]: 0.25 ms against 0.52 for a max and a min kernel each reading the rows."""
    sch = Schedule(func)
    names = inline_elementwise(sch, sch.get_sblock("root"))
    if len(names) != 3 or names[-1] != EXTREMA:
        return None
    width = sch.get(sch.get_sblock(names[0])).iter_vars[-1].dom.extent
    if not isinstance(width, tirx.IntImm) or width.value % lanes:
        return None
    reductions_in_row_tiles(sch, names[:-1], names[-1], lanes)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


# The partial extrema a quantized model's producer writes for the next DynamicQuantizeLinear (tvmdm.transform.
# stats_into_producers), placed in the producer's schedule: under its unit loop, right after the unit wrote its
# output (still in L1), else (a unit that does not cover whole groups of rows) as a parallel pass of their own
# in the same kernel, which reads what the row_extrema kernel they replace read.


def has_partials(sch: Schedule) -> bool:
    return has_block(sch.mod["main"], PARTIALS)


def _over_rows(block) -> bool:
    """Whether the partials reduce over a group's rows (a contraction's), not over a row's vectors: the
    output's column index does not depend on the reduction."""
    reduction = block.iter_vars[-1].var
    column = block.reads[-1].region[-1].min
    return not any(v.same_as(reduction) for v in tirx.analysis.undefined_vars(column))


def _vector_steps(sch: Schedule):
    """The partials as an outer block (returned) over an inner one that takes the maxima of its rows (a
    group's rows, or a row's vectors) a vector at a time: element-wise, no shuffles. The outer block's reads
    are whole slices of the output (its indices one variable each), as reverse_compute_at needs."""
    block = sch.get_sblock(PARTIALS)
    grouped = _over_rows(sch.get(block))  # a group's rows (else a row's vectors)
    if grouped:  # [2, lead..., groups, N]: its columns in vectors, the outer block one vector of columns over
        slot, *middle, vector, reduction = sch.get_loops(block)  # the group's rows
        columns, vector = sch.split(vector, [None, LANES])
        middle.append(columns)
    else:  # [rows..., 2, LANES]
        *middle, slot, vector, reduction = sch.get_loops(block)
    sch.reorder(*middle, reduction, slot, vector)  # the max and the negated min of each vector read once
    sch.unroll(slot)
    sch.vectorize(vector)
    return sch.blockize(reduction if grouped else slot)  # (a row: the outer block one vector of the row)


def place_partials(sch: Schedule, at, covers: bool = True) -> None:
    """The partials under loop ``at`` (the producer's unit, after its output is written) where the unit
    ``covers`` whole rows, or whole groups of GROUP_ROWS rows (a unit that does not would read rows another
    unit has not written); else, or where TVM cannot move them there, as a parallel pass of their own
    (correct, no faster than the row_extrema kernel they replace: tvmdm.transform.stats_into_producers merges
    only where the producers' units cover whole groups)."""
    if not has_partials(sch):
        return
    outer = _vector_steps(sch)
    if covers:
        try:  # a primitive that raises leaves the schedule as it was
            sch.reverse_compute_at(outer, at)
            return
        except DOES_NOT_FIT as err:
            log.warning("quantization statistics not under the producer's unit, a pass of their own: %s",
                        str(err).strip().splitlines()[-1])
    loops = sch.get_loops(outer)
    sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])


class RowNormalizations(ScheduleRule):
    """Row-wise normalizations (LayerNorm, BDRLN, softmax, BLNRD) and lone row reductions, a tile of rows per
    task, on CPUs."""

    name = "row normalizations"

    def schedule(self, func, options):
        if not options.on_cpu:
            return None
        lanes = vector_lanes(options.target)
        return schedule_row_normalization(func, lanes) or schedule_row_reduction(func, lanes) or \
            schedule_row_extrema(func, lanes)
