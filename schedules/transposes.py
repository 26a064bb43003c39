"""2-D transposes B[i, j] = A[j, i] (a training step's W^T for the input gradients dY W^T, the packing those
contractions need): the default rule walks B row by row and reads A a column at a time (a [768, 3072] weight:
5.7 ms). Here: TILE x TILE tiles in parallel, each read and written within L1, the write vectorized: 1.1 ms
(tiles of 16: 1.7, 32: 2.2, 64: 4.1 ms).
Scheduled before the logs apply and left out of tuning, like schedules.reductions."""
from __future__ import annotations

from tvm import tirx
from tvm.s_tir import schedule as sch_mod

from schedules.rule import ScheduleRule, finds_block

TILE = 8  # measured best on the [768, 3072] weight (see above)


def _transpose_block(sch):
    """The kernel's block when it is exactly B[i, j] = A[j, i] with static extents divisible by TILE."""
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1:
        return None
    block = sch.get(blocks[0])
    store = block.body
    # (0.27's loads are ir.TensorLoad nodes, not tirx.BufferLoad: read them by their indices)
    if len(block.iter_vars) != 2 or any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars) or \
            not hasattr(store, "indices") or not hasattr(store.value, "indices"):
        return None
    vi, vj = (iv.var for iv in block.iter_vars)
    written, read = list(store.indices), list(store.value.indices)
    if len(written) != 2 or len(read) != 2 or not (written[0].same_as(vi) and written[1].same_as(vj)
                                                   and read[0].same_as(vj) and read[1].same_as(vi)):
        return None
    if any(not isinstance(iv.dom.extent, tirx.IntImm) or iv.dom.extent.value % TILE for iv in block.iter_vars):
        return None
    return blocks[0]


def is_transpose(func: tirx.PrimFunc) -> bool:
    return finds_block(func, _transpose_block)


def tile_transpose(sch, block, tile: int):
    """``block``'s two loops in tile x tile tiles (each tile's reads and writes stay in L1), the tiles in
    parallel, the inner write loop vectorized; returns the tile's row loop. Also bf16's transposing conversion."""
    i, j = sch.get_loops(block)
    io, ii = sch.split(i, [None, tile])
    jo, ji = sch.split(j, [None, tile])
    sch.reorder(io, jo, ii, ji)
    sch.parallel(sch.fuse(io, jo))
    sch.vectorize(ji)
    return ii


def schedule_transpose(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    sch = sch_mod.Schedule(func)
    block = _transpose_block(sch)
    if block is None:
        return None
    tile_transpose(sch, block, TILE)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


class Transposes(ScheduleRule):
    """2-D transposes in square tiles, on CPUs."""

    name = "transposes"

    def schedule(self, func, options):
        return schedule_transpose(func) if options.on_cpu else None
