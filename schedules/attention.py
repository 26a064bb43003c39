"""The paper level's SM kernel (scores einsum + scale + mask + softmax, reading Q and K in place from the
packed QKV [B, S, 3, h, d]) scheduled by hand where no tuned record covers it (a CPU the shipped logs do
not suit).

The default rule runs each of its five blocks as a separate pass over the [B, h, S, S] scores and reads K
a head's row apart per element: 143 ms for the base layer. Here each (batch, head) is a parallel task that
first copies its Q and K into a [3, d, S] tile (d-major: the scores' inner loop over keys reads it
contiguously), then computes each query row's scores, max, exponentials, sum and normalized probabilities
while the row is in L1: 12.5 ms (measured with another job on the cores; ~11x).
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import Schedule

from schedules.apply import apply_hand_schedule

SM_BLOCKS = ("T_einsum", "T_softmax_maxelem", "T_fast_exp", "T_softmax_expsum", "T_softmax_norm")


def _packed_qkv_scores(sch) -> bool:
    """Whether the kernel is exactly SM on the packed QKV: the five blocks, the scores reading one 5-D buffer."""
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if tuple(sch.get(b).name_hint for b in blocks) != SM_BLOCKS:
        return False
    # (0.27's read regions name their tensor in .source)
    reads = {region.source for region in sch.get(blocks[0]).reads if region.source.name != "T_einsum_intermediate"}
    return len(reads) == 1 and len(next(iter(reads)).shape) == 5


def schedule_sm(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The schedule above, or None when ``func`` is not the packed-QKV SM kernel."""
    sch = Schedule(func)
    if not _packed_qkv_scores(sch):
        return None
    einsum, maxelem, exp, expsum, norm = (sch.get_sblock(name) for name in SM_BLOCKS)
    batch, head, row, _ = sch.get_loops(norm)
    task = sch.fuse(batch, head)
    sch.parallel(task)
    for block in (expsum, exp, maxelem, einsum):
        sch.compute_at(block, row)
    tile = sch.cache_read(einsum, 0, "global")
    sch.transform_layout(tile, ("write", 0), lambda b, s, part, h, d: (b, h, part, d, s))
    sch.compute_at(tile, task)
    *_, key, d = sch.get_loops(einsum)
    sch.reorder(d, key)
    _, vector = sch.split(key, [None, lanes])
    sch.vectorize(vector)  # before decompose_reduction: vectorize refuses an update block without its init
    sch.decompose_reduction(einsum, d)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def apply_attention_schedules(mod: tvm.IRModule, lanes: int) -> tuple[tvm.IRModule, list[str]]:
    """SM kernels not scheduled yet (no log record) get schedule_sm; returns the module and their names."""
    return apply_hand_schedule(mod, lambda func: schedule_sm(func, lanes))
