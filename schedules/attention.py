"""The paper level's attention-score kernels scheduled by hand where no tuned record covers them (a CPU the
shipped logs do not suit): SM (scores einsum + scale + mask + softmax) and the backward pass's einsums of the
same form (dP = dC V^T), out[b, h, i, j] = sum_d A[..i..d] * B[..j..d], with Q/K/V read in place ([B, S, h, d] views or
the packed QKV [B, S, 3, h, d]).

The default rule runs each block as a separate pass over the [B, h, S, S] scores and reads B a head's row
apart per element: SM 143 ms for the base layer. Here each (batch, head) is a parallel task that first copies
its B operand into a tile with the key axis last (the scores' inner loop over keys reads it contiguously,
vectorized), then computes each query row's scores, max, exponentials, sum and normalized probabilities
while the row is in L1: SM ~12.5 ms (measured with another job on the cores; ~11x); in the paper training
step SM 76 -> 6 ms and dP 70 -> 3.6 ms.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import Schedule

from schedules.apply import apply_hand_schedule

SCORES_BLOCK = "T_einsum"
SOFTMAX_BLOCKS = {"T_softmax_maxelem", "T_fast_exp", "T_softmax_exp", "T_softmax_expsum", "T_softmax_norm"}


def _key_operand(block):
    """(tensor, position of the key axis in its indices) for the operand the key axis j of out[b, h, i, j]
    indexes, when ``block`` is such a contraction over one reduction axis; else None."""
    kinds = [iv.iter_type for iv in block.iter_vars]
    if kinds != [tirx.IterVar.DataPar] * 4 + [tirx.IterVar.CommReduce]:
        return None
    key, reduced = block.iter_vars[3].var, block.iter_vars[4].var
    product = getattr(block.body.value, "b", None)  # out + a * b
    loads = [getattr(product, "a", None), getattr(product, "b", None)]
    # Both operands contiguous along the reduction (Q K^T, dP = dC V^T); the context-like contractions
    # (P V: the reduction is the keys) are better left to the default rule (measured 2-3x slower here).
    if not all(getattr(load, "indices", None) and load.indices[-1].same_as(reduced) for load in loads):
        return None
    for load in loads:
        for position, index in enumerate(load.indices):
            if index.same_as(key):
                return load.source, position
    return None


def schedule_scores(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The schedule above, or None when ``func`` is not a scores einsum (alone or followed by its softmax)."""
    sch = Schedule(func)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    if not names or names[0] != SCORES_BLOCK or not set(names[1:]) <= SOFTMAX_BLOCKS:
        return None
    einsum = sch.get_sblock(SCORES_BLOCK)
    found = _key_operand(sch.get(einsum))
    if found is None:
        return None
    tensor, position = found
    last = sch.get_sblock(names[-1])
    batch, head, row, _ = sch.get_loops(last)[:4]
    task = sch.fuse(batch, head)
    sch.parallel(task)
    for name in reversed(names[:-1]):
        sch.compute_at(sch.get_sblock(name), row)
    reads = [region.source for region in sch.get(einsum).reads]  # (0.27's regions name their tensor in .source)
    tile = sch.cache_read(einsum, next(i for i, t in enumerate(reads) if t.same_as(tensor)), "global")
    ndim = len(tensor.shape)
    key_last = tirx.IndexMap.from_func(lambda *idx: (*idx[:position], *idx[position + 1:], idx[position]), ndim=ndim)
    sch.transform_layout(tile, ("write", 0), key_last)
    sch.compute_at(tile, task)
    *_, key, d = sch.get_loops(einsum)
    sch.reorder(d, key)
    _, vector = sch.split(key, [None, lanes])
    sch.vectorize(vector)  # before decompose_reduction: vectorize refuses an update block without its init
    sch.decompose_reduction(einsum, d)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def apply_attention_schedules(mod: tvm.IRModule, lanes: int) -> tuple[tvm.IRModule, list[str]]:
    """Scores kernels not scheduled yet (no log record) get schedule_scores; returns the module and their names."""
    return apply_hand_schedule(mod, lambda func: schedule_scores(func, lanes))
