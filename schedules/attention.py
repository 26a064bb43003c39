"""The paper level's attention kernels scheduled by hand where no tuned record of this CPU model covers them:
SM (scores einsum + scale + mask + softmax) and the backward pass's einsums of the same form (dP = dC V^T),
out[b, h, i, j] = sum_d A[..i..d] * B[..j..d], and the P V form (attention_context, dQ = dS K),
out[.., i, .., d] = sum_j P[.., i, j] * V[.., j, .., d]; Q/K/V read in place ([B, S, h, d] views or the packed
QKV [B, S, 3, h, d]).

Each (batch, head) is a parallel task. SM first copies its key operand into a tile with the key axis last (in
8 x 8 squares: LLVM turned the plain copy into scatter stores), then per ROWS query rows keeps ROWS x
KEY_VECTORS vector accumulators in registers over d (a broadcast query element, a contiguous key-tile row per
step) and runs the row's max, exponentials, sum (both as per-lane partials, vectorized) and normalization
while the rows are in L1. P V keeps ROWS x vectors accumulators over the output columns and reads V's rows in
place. Base layer on a Sapphire Rapids VM (2 cores, AVX-512): SM 1.5 ms against 5.5 ms with the Zen 4 log's
record and 4.8 ms with a scalar softmax and a scattered copy; attention_context 1.1 against 2.1 ms. On a Zen 4
VM without AVX-512, SM by hand takes 12.5 ms or less against 143 ms on the default schedule.

SM and the context in one kernel (tvmdm.transform.attention_kernel, static inference) take SM's schedule with
the context's register tile under each tile of query rows, right after its softmax: the rows' probabilities
are read from L1, never written to memory, and V's rows of the head are copied next to each other once a task
(as K's are). BERT-base layer at (8, 128) on 2 Sapphire Rapids cores, alternating runs against the two
kernels: int8 0.937x the time, fp32 0.972x.
"""
from __future__ import annotations

from tvm import tirx
from tvm.s_tir import Schedule

from schedules.rule import ScheduleRule
from tvmdm.core.target import vector_lanes
from schedules.default import divides, splits_evenly, tile_dividing

SCORES_BLOCK = "T_einsum"
CONTEXT_BLOCK = "T_einsum1"  # the context contraction after SM in one kernel (tvmdm.transform.attention_kernel)
ROWS = {16: 8, 8: 4}  # query rows per register tile, by vector lanes (AVX-512: 8 x 2 accumulators of 32 registers)
TILE = 8  # square of the key-last copy
KEY_VECTORS = 2  # key vectors per register tile (AVX2: 4 x 2 of 16 registers)
# output-column vectors per register tile of P V: ROWS x 2 accumulators and 2 V vectors (AVX-512's 8 x 4 took all
# 32 registers for accumulators and spilled: the base layer's context at (8, 128) on 2 Sapphire Rapids cores
# 1.07 ms against 0.77 with 8 x 2, at (1, 512) 1.87 against 1.40)
CONTEXT_VECTORS = 2
# T_where: the normalization with NaNs zeroed (torch's scaled_dot_product_attention export), softmax_norm inlined
SOFTMAX_BLOCKS = {"T_softmax_maxelem", "T_fast_exp", "T_softmax_exp", "T_softmax_expsum", "T_softmax_norm", "T_where"}


def _key_operand(block, softmax: bool = False):
    """(tensor, position of the key axis in its indices, the leading output axes it indexes) for the operand the
    key axis j of out[b, h, i, j] indexes, when ``block`` is such a contraction over one reduction axis; else
    None. ``softmax``: the contraction is SM's (a softmax over j follows it)."""
    kinds = [iv.iter_type for iv in block.iter_vars]
    if kinds != [tirx.IterVar.DataPar] * 4 + [tirx.IterVar.CommReduce]:
        return None
    key, reduced = block.iter_vars[3].var, block.iter_vars[4].var
    product = getattr(block.body.value, "b", None)  # out + a * b
    loads = [getattr(product, "a", None), getattr(product, "b", None)]
    if not all(getattr(load, "indices", None) for load in loads):
        return None
    # Both operands contiguous along the reduction (Q K^T, dP = dC V^T), or, in SM, the keys' operand already
    # key-last (K^T [B, h, d, S]: torch's dynamo export; left to the default rule, BERT-base took 761 ms at
    # (8, 128) on 2 Sapphire Rapids cores, 671 by hand). Other context-like contractions (P V: the reduction
    # is the keys) are better left to the default rule (measured 2-3x slower here).
    lasts = [load.indices[-1] for load in loads]
    key_last = softmax and sum(i.same_as(reduced) for i in lasts) == 1 and sum(i.same_as(key) for i in lasts) == 1
    if not key_last and not all(i.same_as(reduced) for i in lasts):
        return None
    for load in loads:
        for position, index in enumerate(load.indices):
            if index.same_as(key):
                lead = [t for t, iv in enumerate(block.iter_vars[:3]) if any(i.same_as(iv.var) for i in load.indices)]
                return load.source, position, lead
    return None


def schedule_scores(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The schedule above, or None when ``func`` is not a scores einsum (alone or followed by its softmax, and
    then maybe by the context contraction of its probabilities: tvmdm.transform.attention_kernel's kernel,
    whose query rows are each computed from the probabilities of the same register tile of rows)."""
    sch = Schedule(func)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    context = sch.get_sblock(names.pop()) if len(names) > 2 and names[-1] == CONTEXT_BLOCK else None
    if not names or names[0] != SCORES_BLOCK or not set(names[1:]) <= SOFTMAX_BLOCKS:
        return None
    einsum = sch.get_sblock(SCORES_BLOCK)
    found = _key_operand(sch.get(einsum), softmax=len(names) > 1)
    axes = _context_axes(sch.get(context)) if context is not None else None
    if found is None or (context is not None and (axes is None or found[2] != [0, 1])):
        return None
    tensor, position, lead = found
    # The row max and sum as ``lanes`` partial results (rfactor, vectorized), combined at the row's end.
    partial = []
    for name in names[1:]:
        block = sch.get_sblock(name)
        inner = sch.get_loops(block)[-1]
        if sch.get(block).iter_vars[-1].iter_type == tirx.IterVar.CommReduce and \
                divides(sch.get(inner).extent, lanes):
            _, lane = sch.split(inner, [None, lanes])
            sch.rfactor(lane, factor_axis=len(sch.get(block).iter_vars) - 1)
            partial.append(name)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    if context is not None:  # its (batch, head, row) loops outermost, in the scores' order
        names.pop()
        (batch, head), row, column, reduced = _context_loops(sch, context, axes)
        sch.reorder(batch, head, row)
    else:
        batch, head, row, _ = sch.get_loops(sch.get_sblock(names[-1]))[:4]
    if len(lead) == 2 and lead != [0, 1]:
        # The tasks are the output axes the key operand has (each task copies its key tile): for dQ = dS K
        # written [B, S, h, d] from K^T [B, h, d, S] (a dynamo export's backward) those are B and h, not B
        # and S: a copy per query row made that kernel 12.8 ms a layer instead of ~1.
        loops = [batch, head, row]
        batch, head = (loops[t] for t in lead)
        row = loops[3 - sum(lead)]
        sch.reorder(batch, head, row)
    task = sch.fuse(batch, head)
    sch.parallel(task)
    rows = tile_dividing(sch.get(row).extent, (ROWS.get(lanes, 4), 4, 2, 1))
    row_tile, row_in = sch.split(row, [None, rows])
    for name in reversed(names if context is not None else names[:-1]):
        sch.compute_at(sch.get_sblock(name), row_tile)
    if context is not None:
        _context_tile(sch, context, row_in, column, reduced, lanes)
    reads = [region.source for region in sch.get(einsum).reads]  # (0.27's regions name their tensor in .source)
    tile = sch.cache_read(einsum, next(i for i, t in enumerate(reads) if t.same_as(tensor)), "global",
                          consumer_blocks=[einsum])
    ndim = len(tensor.shape)
    key_last = tirx.IndexMap.from_func(lambda *idx: (*idx[:position], *idx[position + 1:], idx[position]), ndim=ndim)
    sch.transform_layout(tile, ("write", 0), key_last)
    sch.compute_at(tile, task)
    if position == ndim - 1:  # already key-last: a plain copy of the head's slice, in whole vectors
        keys = sch.get_loops(tile)[-1]
        if divides(sch.get(keys).extent, lanes):  # (a symbolic extent cannot be vectorized whole)
            sch.vectorize(sch.split(keys, [None, lanes])[1])
    else:
        _transpose_in_tiles(sch, tile, position)
    if context is not None:  # V's rows of the head copied next to each other once a task (in place, a
        # head's 256-byte segments lie a token's row apart: 3 KB, or 9 KB in the packed QKV, so they fall on
        # a few L1 sets and crowded out the key tile; fp32 base layer at (8, 128) 2.84 against 2.62 ms)
        reads = [region.source for region in sch.get(context).reads]
        copy = sch.cache_read(context, next(i for i, t in enumerate(reads) if t.same_as(axes[2])), "global",
                              consumer_blocks=[context])
        sch.compute_at(copy, task)
        sch.vectorize(sch.get_loops(copy)[-1])
    # The micro-kernel: rows x key_vectors accumulators in registers over the reduction (d), a broadcast query
    # element and a contiguous key-tile row per step.
    *_, i, key, d = sch.get_loops(einsum)
    keys = sch.get(key).extent
    # Other symbolic keys take the ragged path: a predicated key tile made the accumulators a heap buffer of
    # symbolic size (SM 26 ms instead of 17 on the base layer, B=8, S=128); padded ones
    # (tvmdm.transform.attention_padding: blocks * 16) split into whole vectors.
    vectors = next((v for v in (KEY_VECTORS, 1) if divides(keys, v * lanes)), None)
    if vectors is None:  # a ragged key axis: rows of scores, vectorized where they can be
        sch.reorder(d, key)
        sch.decompose_reduction(einsum, d)
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    key_tile, key_vector, lane = sch.split(key, [None, vectors, lanes])
    sch.reorder(key_tile, d, i, key_vector, lane)
    acc = sch.cache_write(einsum, 0, "local")
    sch.reverse_compute_at(acc, key_tile)
    sch.unroll(i)
    sch.unroll(key_vector)
    sch.vectorize(lane)  # before decompose_reduction: vectorize refuses an update block without its init
    init = sch.decompose_reduction(einsum, d)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.split(sch.get_loops(acc)[-1], [None, lanes])[1])
    for name in names[1:]:
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        if name.endswith("_rf") or name in partial:
            # partial max/sum (lane, row, step) -> (row, step, lane), lanes vectorized; their combination
            # (lane, row) -> (row, lane). Found under the row tile, not by position from the end: compute_at
            # drops loops of extent 1 (a row of exactly ``lanes`` keys has no step loop, AVX2's 8 lanes on the
            # tiny layer's 8 keys; a row tile of 1 has no row loop).
            lane, *rest = _loops_under(sch, loops, row_tile)
            if rest:
                sch.reorder(*rest, lane)
            if name.endswith("_rf"):
                sch.vectorize(lane)
        elif splits_evenly(sch.get(loops[-1]).extent, lanes):
            sch.vectorize(sch.split(loops[-1], [None, lanes])[1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _loops_under(sch, loops, outer) -> list:
    """The loops of ``loops`` (a block's, outermost first) nested inside loop ``outer``."""
    at = next(i for i, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(outer)))
    return list(loops[at + 1:])


def _transpose_in_tiles(sch, tile, position: int) -> None:
    """The key-last copy in TILE x TILE squares: each square's rows read contiguously along d and written
    contiguously along the keys (left alone, LLVM vectorized the copy into scatter stores, which took most of
    SM's time on a Sapphire Rapids VM)."""
    loops = sch.get_loops(tile)
    realize = sch.get(loops[-1]).body  # the copy's innermost loop holds its block: which loop feeds which index
    if not hasattr(realize, "iter_values"):
        return
    by_var = {sch.get(loop).loop_var: loop for loop in loops}
    key = next((loop for var, loop in by_var.items() if realize.iter_values[position].same_as(var)), None)
    inner = next((loop for var, loop in by_var.items() if realize.iter_values[-1].same_as(var)), None)
    if key is None or inner is None or key.same_as(inner):
        return
    if not splits_evenly(sch.get(key).extent, TILE) or not splits_evenly(sch.get(inner).extent, TILE):
        return
    key_tile, key_in = sch.split(key, [None, TILE])
    inner_tile, inner_in = sch.split(inner, [None, TILE])
    sch.reorder(key_tile, inner_tile, inner_in, key_in)
    sch.unroll(inner_in)
    sch.vectorize(key_in)


def _context_axes(block):
    """(row, column iter vars, the vectors' tensor) of out[.., r, .., c] = sum_k A[..r..k..] * B[.., k, .., c]:
    the output's last axis c is the last index of one operand (read as vectors: V of P V) and the row axis r
    indexes only the other (read as broadcast scalars, in any order: P[.., i, j] for the context, P^T for dV =
    P^T dC and dK = dS^T Q); else None."""
    kinds = [iv.iter_type for iv in block.iter_vars]
    if kinds != [tirx.IterVar.DataPar] * 4 + [tirx.IterVar.CommReduce]:
        return None
    spatial = [iv.var for iv in block.iter_vars[:4]]
    product = getattr(block.body.value, "b", None)  # out + a * b
    loads = [getattr(product, "a", None), getattr(product, "b", None)]
    if not all(getattr(load, "indices", None) for load in loads):
        return None
    column = block.body.indices[-1]
    if not any(column.same_as(v) for v in spatial):
        return None
    vectors = [load for load in loads if load.indices[-1].same_as(column)]
    if len(vectors) != 1:
        return None
    scalars = loads[1] if vectors[0] is loads[0] else loads[0]
    if any(i.same_as(column) for i in scalars.indices):
        return None
    row = next((v for v in spatial if any(i.same_as(v) for i in scalars.indices)
                and not any(i.same_as(v) for i in vectors[0].indices)), None)
    return None if row is None else (row, column, vectors[0].source)


def _context_loops(sch: Schedule, einsum, axes) -> tuple:
    """(the other spatial loops, in order, then the row, column and reduction loops) of a context-like
    contraction whose _context_axes are ``axes``."""
    loops = sch.get_loops(einsum)
    by_var = dict(zip([iv.var for iv in sch.get(einsum).iter_vars], loops))
    others = [loop for var, loop in list(by_var.items())[:4] if not var.same_as(axes[0]) and not var.same_as(axes[1])]
    return others, by_var[axes[0]], by_var[axes[1]], loops[4]


def schedule_context(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The P V form alone in a kernel (attention_context; in the backward pass dQ = dS K, dK = dS^T Q and
    dV = P^T dC): a task per (batch, head), ROWS x vectors accumulators over the output columns, a broadcast
    P element and a contiguous V row segment per step (the V rows of one head are 256 bytes each, read in
    place)."""
    sch = Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1 or sch.get(blocks[0]).name_hint != SCORES_BLOCK:
        return None
    einsum = blocks[0]
    axes = _context_axes(sch.get(einsum))
    if axes is None:
        return None
    others, row, column, reduced = _context_loops(sch, einsum, axes)
    if not divides(sch.get(column).extent, lanes):
        return None
    rows = tile_dividing(sch.get(row).extent, (ROWS.get(lanes, 4), 4, 2, 1))
    row_tile, row_in = sch.split(row, [None, rows])
    sch.reorder(*others, row_tile, row_in)
    sch.parallel(sch.fuse(*others))
    _context_tile(sch, einsum, row_in, column, reduced, lanes)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _context_tile(sch: Schedule, einsum, row_in, column, reduced, lanes: int) -> None:
    """P V's register tile under its row tile (the loops of its rows, the output columns and the reduction,
    in that order, inside it): rows x vectors accumulators over the output columns, a broadcast P element and
    a contiguous V row segment per step."""
    columns = sch.get(column).extent
    vectors = next((v for v in (CONTEXT_VECTORS, 1) if divides(columns, v * lanes)), None)
    if vectors is None:  # ragged columns: the reduction outside, the columns vectorized where they can be
        sch.reorder(reduced, column)
        return
    column_tile, column_vector, lane = sch.split(column, [None, vectors, lanes])
    sch.reorder(column_tile, reduced, row_in, column_vector, lane)
    acc = sch.cache_write(einsum, 0, "local")
    sch.reverse_compute_at(acc, column_tile)
    sch.unroll(row_in)
    sch.unroll(column_vector)
    sch.vectorize(lane)
    init = sch.decompose_reduction(einsum, reduced)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.split(sch.get_loops(acc)[-1], [None, lanes])[1])


class AttentionKernels(ScheduleRule):
    """The paper's attention kernels (SM's scores and the context contraction), on CPUs."""

    name = "attention"

    def schedule(self, func, options):
        if not options.on_cpu:
            return None
        lanes = vector_lanes(options.target)
        return schedule_scores(func, lanes) or schedule_context(func, lanes)
