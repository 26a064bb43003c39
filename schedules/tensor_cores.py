"""CUDA: every fp16 contraction on tensor cores (WMMA), its block tile chosen so the grid fills the GPU.

dlight's Matmul rule leaves two kinds of fp16 contraction of a BERT layer off the tensor cores or short of the
GPU: (1) any with a dim of 64 or less, which are the attention's (the scores reduce over the head dim 64, the
context writes 64 columns): they ran as fp32-speed SIMT code; (2) its tensor-core schedule has one block tile,
128 x 128, so the N=768 contractions (output projection, FFN2) at (8, 128) launch 8 x 6 = 48 blocks on an H100's
132 SMs. This rule takes any kernel with one contraction of fp16 operands (fp32 or fp16 accumulator; element-
wise epilogues stay fused), with static extents that a tile divides (64 rows and columns or more, a reduction in steps of 16):
  - the contraction is normalized as dlight's rules do (C[b, i, j] += A[b, i, k] * B[b, j, k], by reindexing)
    and tiled in 16 x 16 x 16 WMMA fragments;
  - the block tile is the largest of TILES that divides the matrix and gives at least one block per SM (else
    the one with the most blocks);
  - each operand is copied to shared memory with its contiguous global axis innermost, 16 bytes per thread
    per load: the weights, [K, N] in ONNX, are read along N (a load along K, as a plain reindex reads them,
    took 2-byte loads 4,608 bytes apart);
  - the accumulator goes through shared memory to the epilogue, which is written coalesced.
A kernel it does not fit (symbolic extents, fp32 operands, several reductions) is left to dlight's rules.
"""
from __future__ import annotations

import dataclasses

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, get_index_map,
                                         get_reduction_blocks)

from tvmdm.core.target import cuda_multiprocessors

FRAGMENT = 16  # WMMA m16n16k16
WARP = 32
VECTOR = 8  # fp16 elements per 16-byte load


@dataclasses.dataclass(frozen=True)
class Tile:
    warps_i: int  # warps along the output rows
    warps_j: int
    frags_i: int  # 16 x 16 fragments each warp accumulates
    frags_j: int
    frags_k: int = 4  # the k step staged in shared memory: 64 (a 1 here builds: it is no split factor)

    @property
    def rows(self) -> int:
        return FRAGMENT * self.warps_i * self.frags_i

    @property
    def cols(self) -> int:
        return FRAGMENT * self.warps_j * self.frags_j

    @property
    def warps(self) -> int:
        return self.warps_i * self.warps_j


# Largest first: 128 x 128 (16 warps, dlight's tile) down to 64 x 64 (4 warps of 2 x 2 fragments). A factor
# of 1 (one warp along an axis, one fragment per warp) is left out: TVM 0.27 drops the unit loop and the
# lowered WMMA loads then point at the fp32 accumulator's shared buffer ("tvm_access_ptr element type must
# match"). So at (1, 128) the N=768 contractions get 24 blocks; filling the GPU there needs a split K.
TILES = (Tile(4, 4, 2, 2), Tile(4, 2, 2, 2), Tile(2, 4, 2, 2), Tile(2, 2, 2, 2))


def pick_tile(batch: int, rows: int, cols: int, reduce: int, multiprocessors: int) -> Tile | None:
    """Among the tiles that divide the matrix (no padded tiles), the largest whose grid has a block per SM,
    else the one with the most blocks; the k step the largest that divides the reduction. None: no tile
    divides it (fewer than 64 rows or columns)."""
    def blocks(tile: Tile) -> int:
        return batch * (rows // tile.rows) * (cols // tile.cols)

    dividing = [t for t in TILES if rows % t.rows == 0 and cols % t.cols == 0]
    if not dividing or reduce % FRAGMENT:
        return None
    tile = next((t for t in dividing if blocks(t) >= multiprocessors), max(dividing, key=blocks))
    frags_k = next(f for f in (4, 2, 1) if reduce % (FRAGMENT * f) == 0)
    return dataclasses.replace(tile, frags_k=frags_k)


def _static(value) -> int | None:
    return int(value) if isinstance(value, tirx.IntImm) else None


def _half_operands(block) -> bool:
    reads = [r.source.dtype for r in block.reads]
    return len(block.reads) >= 2 and all(d == "float16" for d in reads[:2]) and \
        block.writes[0].source.dtype in ("float16", "float32")


def _contiguous_reduction(block, position: int) -> bool:
    """Whether operand ``position`` of ``block`` is read with the reduction axis innermost (A[i, k], B[j, k])."""
    reduced = {iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    last = block.reads[position].region[-1].min
    return any(last.same_as(v) for v in reduced)


def schedule_tensor_cores(func: tirx.PrimFunc, target) -> s_tir.Schedule | None:
    """The schedule above, or None where it does not apply."""
    from schedules.intrinsics_import import import_cuda_intrinsics

    import_cuda_intrinsics()
    from tvm.s_tir.tensor_intrin.cuda import get_wmma_intrin_group

    sch = s_tir.Schedule(func)
    reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    if not reductions or len(reductions) != 1:
        return None
    main = reductions[0]
    stmt = sch.get(main)
    if not _half_operands(stmt) or get_index_map(stmt) is None:
        return None
    k_inner = [_contiguous_reduction(stmt, p) for p in (0, 1)]
    out_dtype = stmt.writes[0].source.dtype

    reindexed = [sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)), sch.reindex(main, ("write", 0))]
    matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(reindexed[0], ("write", 0), a_map)
    sch.transform_layout(reindexed[1], ("write", 0), b_map)
    sch.transform_layout(reindexed[2], ("read", 0), c_map)
    sch.transform_block_layout(main, matmul_map)
    extents = [_static(iv.dom.extent) for iv in sch.get(main).iter_vars]
    if None in extents or any(e % FRAGMENT for e in extents[1:]):
        return None
    batch, rows, cols, reduce = extents
    tile = pick_tile(batch, rows, cols, reduce, cuda_multiprocessors(target))
    if tile is None:
        return None

    b, i, j, k = sch.get_loops(main)
    i, i_frag = sch.split(i, [None, FRAGMENT])
    j, j_frag = sch.split(j, [None, FRAGMENT])
    k, k_frag = sch.split(k, [None, FRAGMENT])
    sch.reorder(i, j, k, i_frag, j_frag, k_frag)
    fragment_block = main
    outer = sch.blockize(i_frag)
    i0, i1, i2 = sch.split(i, [None, tile.warps_i, tile.frags_i])
    j0, j1, j2 = sch.split(j, [None, tile.warps_j, tile.frags_j])
    k0, k1 = sch.split(k, [None, tile.frags_k])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(b, "blockIdx.z")
    sch.bind(sch.fuse(i0, j0), "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")

    def stage_in_shared(index: int, reduction_inner: bool):
        copy = sch.cache_read(outer, index, "shared.dyn")
        sch.compute_at(copy, k0)
        rows_loop, k_loop = sch.get_loops(copy)[-2:]
        if not reduction_inner:  # global memory is contiguous along the rows/cols axis: make it the inner one
            sch.reorder(k_loop, rows_loop)
            rows_loop, k_loop = k_loop, rows_loop
        fused = sch.fuse(rows_loop, k_loop)
        _, ty, tx, vec = sch.split(fused, [None, tile.warps, WARP, VECTOR])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vec)
        sch.storage_align(copy, 0, axis=-2, factor=16, offset=8)  # rows 16 bytes apart: no bank conflicts
        return copy

    copies = [stage_in_shared(p, k_inner[p]) for p in (0, 1)]
    for copy in copies:
        auto_inline_producers(sch, copy)
    fragments = [sch.cache_read(outer, p, scope) for p, scope in ((0, "wmma.matrix_a"), (1, "wmma.matrix_b"))]
    for frag in fragments:
        sch.compute_at(frag, k1)
    through_shared = sch.cache_write(outer, 0, "shared.dyn")
    sch.storage_align(through_shared, 0, -2, 16, 4)
    accumulator = sch.cache_write(outer, 0, "wmma.accumulator")
    sch.reverse_compute_at(accumulator, warp)
    sch.reverse_compute_at(through_shared, warp)
    init = sch.get_child_blocks(sch.decompose_reduction(outer, k0))[0]

    intrinsics = get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16",
                                       out_dtype=out_dtype, trans_b=True)
    try:
        for frag, kind in zip(fragments + [accumulator], ("load_a", "load_b", "store")):
            ii, jj = sch.get_loops(frag)[-2:]
            ii0, ii1 = sch.split(ii, [None, FRAGMENT])
            jj0, jj1 = sch.split(jj, [None, FRAGMENT])
            sch.reorder(ii0, jj0, ii1, jj1)
            if kind != "store":
                sch.unroll(ii0)
                sch.unroll(jj0)
            sch.tensorize(ii1, intrinsics[kind])
        sch.tensorize(sch.get_loops(init)[-2], intrinsics["init"])
        sch.tensorize(sch.get_loops(fragment_block)[-3], intrinsics["compute"])
    except Exception:  # noqa: BLE001 - a shape the intrinsics do not take: dlight's rules instead
        return None
    auto_inline_consumer_chain(sch, through_shared)
    fused = sch.fuse(*sch.get_loops(through_shared)[-2:])
    _, tx, vec = sch.split(fused, [None, WARP, 4])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    return sch


class TensorCoreContractions:
    """The rule above in dlight's protocol (``apply(func, target, tunable)``), tried before dlight's rules."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool = False):
        if target.kind.name != "cuda" or not isinstance(func, tirx.PrimFunc):
            return None
        return schedule_tensor_cores(func, target)
