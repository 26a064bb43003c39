"""The bf16 contraction's schedule on CPUs with AMX-BF16 (Sapphire Rapids): the tile units.

One ``tdpbf16ps`` multiplies a 16 x 32 bf16 tile of activations by a 16 (k pairs) x 16 (columns) x 2 tile of
weights into a 16 x 16 fp32 accumulator tile. The weights are already stored as AMX reads them: tvmdm.precision
packs them once at load as [N/16, K/2, 16, 2] bf16 bits (the AVX512-BF16 layout), so each B tile is 1 KiB
contiguous, 64 bytes a row. The activations (bf16 bits, [rows, K]) are read in place, a row apart.

A unit of work (one tensorized call) is ``GROUP`` blocks of 32 rows by 32 columns over the whole of K: per
block, 4 accumulator tiles (tmm0-3) from 2 activation tiles (tmm4-5) and 2 weight tiles (tmm6-7), all 8 tiles
of palette 1, K in steps of 32. The blocks of a unit share their weight tiles (read from L1/L2 once per block
row) and the unit loads the tile configuration once. The accumulators go out to a 32G x 32 fp32 buffer on the
stack, from which the fused epilogue (bias, GELU, residual, the next operator's bf16 conversion) is computed while
it is in L1. Units run in parallel over the cores; each unit loads the tile configuration itself (a thread's
tile state is its own) and releases it at its end. With symbolic rows (padded to whole blocks), and static
rows of 8 blocks or more (_static_panels), a unit is one block of 32 rows over a panel of weight columns that
stays in L2 (panel_blocks), the units walking the rows under each panel.

The int8 contractions of quantized models (schedules.int8) take the same units on AMX-INT8: ``tdpbusd``
multiplies a 16 x 64 uint8 activation tile by a 16 (k quads) x 16 x 4 int8 weight tile (vpdpbusd's packing,
[N/16, K/4, 16, 4]: again 1 KiB per B tile) into int32 accumulators, K in steps of 64 (``TileOp``).

A process must ask Linux for the tile data state before its first tile instruction (tvmdm.runtime.amx);
modules built with these kernels do so when they load (``AMX_ATTR`` marks them).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import tvm
import tvm.sym
from tvm import tirx
from tvm.s_tir import Schedule, TensorIntrin
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.script import tirx as T

from schedules.default import inline_elementwise
from schedules.packed import epilogue_into_tile
from schedules.bf16 import has_bf16_dot
from schedules.rows import place_partials
from schedules.rule import FLOPS_ATTR, ScheduleRule
from tvmdm.core.target import has_amx_bf16
from tvmdm.transform.int8_kernels import INT8_GEMM_BLOCK, VNNI
from tvmdm.transform.kernels import GEMM_BLOCK, LANES, PAIR, bf16_value
from tvmdm.transform.stats_into_producers import GROUP_ROWS
from tvmdm.transform.ir import has_block

TILE_ROWS = 16  # rows of every tile (palette 1 allows 16)
TILE_BYTES = 64  # bytes per tile row: 32 bf16 or 16 fp32
BLOCK = 2 * TILE_ROWS  # columns of a block (2 accumulator tiles wide), and its rows where they divide by 32
K_STEP = TILE_BYTES // 2  # bf16 values of K per activation tile row
GROUPS = (4, 2, 1)  # blocks of rows per unit, the largest that divides the rows
# Symbolic rows: the weight columns one unit covers (panel_blocks). The units walk every row block under one
# panel, so it must stay in L2 (2 MiB per Sapphire Rapids core): one 32-column block per unit re-read all the
# rows per block (BERT-base FFN down at 512 rows: 1.84 ms, against 0.97 with this panel and 0.91 static rows).
PANEL_BYTES = 1_200_000
PANEL_MIN_BLOCKS = 8  # blocks of rows from which static rows take the panel units too (_static_panels)
AMX_ATTR = "tvmdm.amx"  # a kernel on the tile units (not emulated)
# Weight tiles are prefetched (into L2) this many K steps ahead: a core's first unit under a panel streams the
# panel from memory, and the tile loads alone do not run ahead of it (BERT-base's int8 dynamo export at
# (8, 128), 2 Sapphire Rapids cores: FFN1 in place 2.18 against 2.43 ms a layer; the model 0.977x-0.989x,
# bf16 0.99x; 16 steps ahead the same as 8)
PREFETCH_STEPS = 8
EMULATE = False  # tests: every tile instruction as the loops it stands for (see amx_intrin), on any CPU

# Tile numbers: four accumulators (block row i, column j -> 2i + j), two activation tiles, two weight tiles.
ACC, A_TILES, B_TILES = (0, 1, 2, 3), (4, 5), (6, 7)


@dataclasses.dataclass(frozen=True)
class TileOp:
    """One kind of tile product: activations of ``a_dtype`` (``a_bytes`` each) times weights packed as
    [N/16, K/group, 16, group] of ``w_dtype`` into ``acc_dtype`` accumulators by ``instruction``; ``value``
    turns an element into the accumulator type; ``block``: the contraction block the rule schedules."""
    instruction: str
    block: str
    a_dtype: str
    w_dtype: str
    acc_dtype: str
    group: int
    value: object

    @property
    def a_bytes(self) -> int:
        return 2 if self.a_dtype == "uint16" else 1

    @property
    def w_bytes(self) -> int:
        return 2 if self.w_dtype == "uint16" else 1

    @property
    def k_step(self) -> int:  # K per activation tile row (64 bytes)
        return TILE_BYTES // self.a_bytes


BF16_TILES = TileOp("tdpbf16ps", GEMM_BLOCK, "uint16", "uint16", "float32", PAIR, bf16_value)
INT8_TILES = TileOp("tdpbusd", INT8_GEMM_BLOCK, "uint8", "int8", "int32", VNNI.group, lambda v: v.astype("int32"))


def tile_config_words() -> list[int]:
    """The 64-byte tile configuration as 8 little-endian uint64 words: palette 1 (byte 0), each of the 8 tiles
    16 rows (bytes 48-55) of 64 bytes (u16 at bytes 16-31)."""
    config = bytearray(64)
    config[0] = 1
    for tile in range(8):
        config[16 + 2 * tile: 18 + 2 * tile] = TILE_BYTES.to_bytes(2, "little")
        config[48 + tile] = TILE_ROWS
    return [int.from_bytes(config[8 * i: 8 * i + 8], "little") for i in range(8)]


TILE_CONFIG = tile_config_words()


def tile_instruction(name: str, *args):
    """A call of LLVM's x86 intrinsic ``name`` (the tile instructions: ldtilecfg, tileloadd64, tdpbf16ps, ...)."""
    return T.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


@T.macro
def load_tile_config(config):
    """This thread's tile configuration (tile_config_words) from ``config``, a local buffer of 8 uint64."""
    for word in T.unroll(8):
        config[word] = T.uint64(0)
    config[0] = T.uint64(TILE_CONFIG[0])  # palette
    config[2] = T.uint64(TILE_CONFIG[2])  # bytes per row, tiles 0-3
    config[3] = T.uint64(TILE_CONFIG[3])  # tiles 4-7
    config[6] = T.uint64(TILE_CONFIG[6])  # rows, tiles 0-7
    T.evaluate(tile_instruction("ldtilecfg", T.address_of(config[0])))


@functools.lru_cache(maxsize=None)
def amx_intrin(k: int, groups: int, block_rows: int = BLOCK, emulate: bool = False, op: TileOp = BF16_TILES,
               col_blocks: int = 1) -> str:
    """Register (once) and name the tensor intrinsic of one unit: ``groups`` blocks of ``block_rows`` (32, or
    16: one activation tile and two accumulators) x ``col_blocks`` blocks of 32 columns over K = ``k`` (a
    multiple of ``op.k_step``) with ``op``'s tile product, the tile configuration loaded once. Its accumulators
    start at zero in the tiles (tilezero) and it never reads ``c``: only the unit's zeroing (tile_zero_intrin,
    which emits nothing) may come before it, and schedule_amx_gemm tensorizes the two together. ``emulate``:
    each tile instruction replaced by the loops it stands for (what the tile units compute, on any CPU): tests
    check the kernels' tiles and addresses with it where there is no AMX."""
    rows, cols = block_rows * groups, BLOCK * col_blocks
    a_count = block_rows // TILE_ROWS  # activation tiles per block; accumulators: 2 per activation tile
    half, group, k_step = k // op.group, op.group, op.k_step
    name = f"tvmdm_amx_{op.instruction}_{block_rows}x{groups}x{BLOCK}x{col_blocks}x{k}" + (
        "_emulated" if emulate else "")

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer((rows, k), op.a_dtype, offset_factor=1),
             w: T.Buffer((2 * col_blocks, half, LANES, group), op.w_dtype, offset_factor=1),
             c: T.Buffer((rows, cols), op.acc_dtype, offset_factor=1, scope="local")):
        with T.sblock("root"):
            T.reads(c[0:rows, 0:cols], a[0:rows, 0:k], w[0:2 * col_blocks, 0:half, 0:LANES, 0:group])
            T.writes(c[0:rows, 0:cols])
            for i, j, r in T.grid(rows, cols, k):
                with T.sblock("update"):
                    vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                    c[vi, vj] = c[vi, vj] + op.value(a[vi, vr]) * op.value(
                        w[vj // LANES, vr // group, vj % LANES, vr % group])

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, w_handle: T.handle, c_handle: T.handle):
        a_stride = T.int32()
        w_stride = T.int32()
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, k), op.a_dtype, offset_factor=1, strides=[a_stride, 1])
        w = T.match_buffer(w_handle, (2 * col_blocks, half, LANES, group), op.w_dtype, offset_factor=1,
                           strides=[w_stride, LANES * group, group, 1])
        c = T.match_buffer(c_handle, (rows, cols), op.acc_dtype, offset_factor=1, scope="local",
                           strides=[c_stride, 1])
        with T.sblock("root"):
            T.reads(c[0:rows, 0:cols], a[0:rows, 0:k], w[0:2 * col_blocks, 0:half, 0:LANES, 0:group])
            T.writes(c[0:rows, 0:cols])
            # emulate: the same tiles in local buffers, each tile instruction as the loops it stands for
            acc_tiles = T.decl_buffer((2 * a_count, TILE_ROWS, LANES), op.acc_dtype, scope="local")
            a_tiles = T.decl_buffer((a_count, TILE_ROWS, k_step), op.a_dtype, scope="local")
            b_tiles = T.decl_buffer((2, TILE_ROWS, LANES, group), op.w_dtype, scope="local")
            config = T.decl_buffer((8,), "uint64", scope="local")
            if not emulate:
                load_tile_config(config)
            for block in range(groups * col_blocks):
                row0, col0 = block // col_blocks * block_rows, block % col_blocks * BLOCK  # its first row, column
                for t in T.unroll(2 * a_count):  # accumulator t: block row t // 2, column t % 2
                    if emulate:
                        for r, x in T.grid(TILE_ROWS, LANES):
                            acc_tiles[t, r, x] = T.cast(0, op.acc_dtype)
                    else:
                        T.evaluate(tile_instruction("tilezero", T.int8(t)))
                for step in range(k // k_step):
                    for t in T.unroll(a_count):  # activation rows t * 16.., K step * 32..
                        if emulate:
                            for r, x in T.grid(TILE_ROWS, k_step):
                                a_tiles[t, r, x] = a[row0 + t * TILE_ROWS + r, step * k_step + x]
                        else:
                            T.evaluate(tile_instruction("tileloadd64", T.int8(A_TILES[0] + t), a.access_ptr(
                                "r", offset=(row0 + t * TILE_ROWS) * a_stride + step * k_step),
                                T.int64(a_stride * op.a_bytes)))
                    for t in T.unroll(2):  # weight columns t * 16.., k groups step * 16..
                        if emulate:
                            for r, x, p in T.grid(TILE_ROWS, LANES, group):
                                b_tiles[t, r, x, p] = w[col0 // LANES + t, step * TILE_ROWS + r, x, p]
                        else:
                            T.evaluate(tile_instruction("tileloadd64", T.int8(B_TILES[0] + t), w.access_ptr(
                                "r", offset=(col0 // LANES + t) * w_stride + step * TILE_ROWS * LANES * group),
                                T.int64(TILE_BYTES)))
                            for line in T.unroll(TILE_ROWS):  # (a hint: past the last step it cannot fault)
                                T.evaluate(T.call_intrin("void", "tirx.prefetch", w.access_ptr(
                                    "r", offset=(col0 // LANES + t) * w_stride + (step + PREFETCH_STEPS)
                                    * TILE_ROWS * LANES * group + line * LANES * group), 0, 2, 1))
                    for t in T.unroll(2 * a_count):
                        if emulate:  # C[m, n] += sum over groups j of A[m, group * j + p] * B[j, n, p]
                            for m, x, j, p in T.grid(TILE_ROWS, LANES, TILE_ROWS, group):
                                acc_tiles[t, m, x] = acc_tiles[t, m, x] + op.value(
                                    a_tiles[t // 2, m, j * group + p]) * op.value(b_tiles[t % 2, j, x, p])
                        else:
                            T.evaluate(tile_instruction(op.instruction, T.int8(ACC[0] + t),
                                                        T.int8(A_TILES[0] + t // 2), T.int8(B_TILES[0] + t % 2)))
                for t in T.unroll(2 * a_count):
                    if emulate:
                        for r, x in T.grid(TILE_ROWS, LANES):
                            c[row0 + t // 2 * TILE_ROWS + r, col0 + t % 2 * LANES + x] = acc_tiles[t, r, x]
                    else:
                        T.evaluate(tile_instruction("tilestored64", T.int8(t), c.access_ptr(
                            "w", offset=(row0 + t // 2 * TILE_ROWS) * c_stride + col0 + t % 2 * LANES),
                            T.int64(c_stride * 4)))
            if not emulate:
                T.evaluate(tile_instruction("tilerelease"))

    TensorIntrin.register(name, desc, impl, override=True)
    return name


@functools.lru_cache(maxsize=None)
def tile_zero_intrin(rows: int, cols: int, acc_dtype: str) -> str:
    """Register (once) and name the intrinsic that takes the place of the zeroing of a unit's ``rows`` x ``cols``
    accumulators: it emits nothing, because amx_intrin, which the same unit runs next, starts its accumulator
    tiles with tilezero and never reads the buffer (the zeros were a memset of up to 32 x 768 int32 per unit,
    loaded back into the tiles). schedule_amx_gemm tensorizes the two together."""
    name = f"tvmdm_amx_zero_{rows}x{cols}_{acc_dtype}"

    @T.prim_func(s_tir=True)
    def desc(c: T.Buffer((rows, cols), acc_dtype, offset_factor=1, scope="local")):
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:cols])
            for i, j in T.grid(rows, cols):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = T.cast(0, acc_dtype)

    @T.prim_func(s_tir=True)
    def impl(c_handle: T.handle):
        c_stride = T.int32()
        c = T.match_buffer(c_handle, (rows, cols), acc_dtype, offset_factor=1, scope="local", strides=[c_stride, 1])
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:cols])
            T.evaluate(0)

    TensorIntrin.register(name, desc, impl, override=True)
    return name


def tile_block_rows(rows: int, n: int, k: int, k_step: int = K_STEP) -> int | None:
    """The rows of a block for a contraction of ``rows`` rows (its last leading dim), N and K (in steps of
    ``k_step``): 32, or 16 where the rows only divide by 16; None where whole tiles do not fit."""
    if n % BLOCK or k % k_step:
        return None
    return next((r for r in (BLOCK, TILE_ROWS) if rows % r == 0), None)


def panel_blocks(n: int, k: int, op: TileOp = BF16_TILES) -> int:
    """Column blocks per unit for symbolic rows: the most that divide N/32 with their weights (32 columns x K
    each) within PANEL_BYTES, so that the panel stays in the core's L2 while its units walk every row block."""
    blocks = n // BLOCK
    fits = [c for c in range(1, blocks + 1) if blocks % c == 0 and c * BLOCK * k * op.w_bytes <= PANEL_BYTES]
    return max(fits, default=1)


def _unit_rows(sch, m, n_extent: int, k_extent: int, k_step: int) -> tuple[int, int] | None:
    """(rows of a block, blocks per unit) for the row loop ``m``; None where whole tiles do not fit. Symbolic
    rows come padded to whole blocks (tvmdm.transform.kernels.TILE_ROW_PAD): one block of rows per unit (over
    a panel of weight columns, panel_blocks)."""
    extent = sch.get(m).extent
    if not isinstance(extent, tirx.IntImm):
        analyzer = tvm.sym.Analyzer()
        fits = n_extent % BLOCK == 0 and k_extent % k_step == 0 and analyzer.can_prove(
            tirx.floormod(extent, BLOCK) == 0)
        return (BLOCK, 1) if fits else None
    rows = tile_block_rows(int(extent), n_extent, k_extent, k_step)
    if rows is None:
        return None
    return rows, next(g for g in GROUPS if int(extent) % (rows * g) == 0)


def _static_panels(rows: int, block_rows: int, outer, sch) -> bool:
    """Whether static rows take symbolic rows' units (a block of rows over a panel of columns) rather than
    GROUPS blocks of rows by one block of columns: where they are 32-row blocks and at least PANEL_MIN_BLOCKS of
    them (fewer leave cores idle, a unit each). A unit reads its block of activations from L1 across the
    panel's columns, and the panel's weights stay in L2. BERT-base's int8 dynamo export at (8, 128), 2 Sapphire
    Rapids cores: a 768 x 768 projection alone 0.294 against 0.327 ms, FFN1 1.57-1.79 against 1.73-1.82; the whole model
    0.975x and 0.980x (alternating runs, same outputs), bf16 0.999x and 0.984x."""
    extents = [sch.get(loop).extent for loop in outer]
    if not all(isinstance(e, tirx.IntImm) for e in extents):
        return False
    return block_rows == BLOCK and math.prod(int(e) for e in extents) * rows // BLOCK >= PANEL_MIN_BLOCKS


def schedule_amx_gemm(func: tirx.PrimFunc, emulate: bool = False, op: TileOp = BF16_TILES) -> tirx.PrimFunc | None:
    """The tile schedule for a kernel holding ``op``'s contraction block (``bf16_gemm``, or ``int8_gemm`` on
    vpdpbusd's packing; and fused epilogues); None where its shape does not fill whole blocks (rows, N or K
    off the block size; symbolic rows not padded to whole blocks)."""
    sch = Schedule(func)
    inline_elementwise(sch, sch.get_sblock("root"))
    gemm = sch.get_sblock(op.block)
    *outer, m, n, k = sch.get_loops(gemm)
    if not all(isinstance(sch.get(x).extent, tirx.IntImm) for x in (n, k)):
        return None
    n_extent, k_extent = int(sch.get(n).extent), int(sch.get(k).extent)
    unit_rows = _unit_rows(sch, m, n_extent, k_extent, op.k_step)
    if unit_rows is None:
        return None
    rows, groups = unit_rows
    static_rows = isinstance(sch.get(m).extent, tirx.IntImm)
    panels = not static_rows or _static_panels(int(sch.get(m).extent), rows, outer, sch)
    if panels:
        groups = 1
    mo, mi = sch.split(m, [None, rows * groups])
    no, ni = sch.split(n, [None, BLOCK])
    if not panels:
        sch.reorder(*outer, mo, no, mi, ni, k)
        unit = sch.fuse(*outer, mo, no)
        col_blocks = 1
    else:  # one block of rows per unit, over a panel of columns; units walk the rows under one panel
        col_blocks = panel_blocks(n_extent, k_extent, op)
        panel, nc = sch.split(no, [None, col_blocks])
        sch.reorder(panel, *outer, mo, mi, nc, ni, k)
        unit = sch.fuse(panel, *outer, mo)
        ni = sch.fuse(nc, ni)
    sch.parallel(unit)
    if static_rows:
        acc = sch.cache_write(gemm, 0, "local")
        sch.reverse_compute_at(acc, unit)
    else:  # row_tiles' whole blocks are already an intermediate, copied out per unit (guarded)
        acc = gemm
        sch.set_scope(gemm, 0, "local")
        copy_out = sch.get_consumers(gemm)
        for block in copy_out:  # before tensorize replaces the block they read
            sch.reverse_compute_at(block, unit)
    # The zeros start in the tiles (tilezero), not in memory: a 768 x 768 int8 projection of BERT-base alone
    # 0.283 against 0.344 ms
    init = sch.decompose_reduction(gemm, mi)
    sch.tensorize(sch.get_loops(init)[-2], tile_zero_intrin(rows * groups, BLOCK * col_blocks, op.acc_dtype))
    sch.tensorize(mi, amx_intrin(k_extent, groups, rows, emulate, op, col_blocks))
    if static_rows:
        epilogue_into_tile(sch, acc, unit, LANES)
        place_partials(sch, unit, covers=rows * groups % GROUP_ROWS == 0)  # the next quantization's stats
    else:
        for block in copy_out:
            inner = sch.get_loops(block)[-1]
            sch.vectorize(sch.split(inner, [None, LANES])[1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr(AMX_ATTR, not emulate)


class AmxContractions(ScheduleRule):
    """precision="bf16" on a CPU with AMX-BF16: every bf16 contraction whose shape fills whole 32 x 32 blocks
    over K in steps of 32 on the tile units. Others (symbolic rows, odd shapes) and the transposing
    conversions go on to schedules.bf16 (AVX512-BF16, which every AMX CPU has)."""

    name = "amx contractions"

    def apply(self, kernels: dict, options) -> dict:
        if not (options.on_cpu and options.precision == "bf16"):
            return {}
        if not (has_amx_bf16(options.target) or EMULATE):
            if has_bf16_dot(options.target) and any(has_block(f, GEMM_BLOCK) for f in kernels.values()):
                warnings.warn(f"target {options.target} has no AMX-BF16 tile units: the bf16 contractions run on "
                              "AVX512-BF16 dot products (vdpbf16ps; same results, slower)", stacklevel=2)
            return {}
        return super().apply(kernels, options)

    def schedule(self, func, options):
        if not has_block(func, GEMM_BLOCK):
            return None
        scheduled = schedule_amx_gemm(func, emulate=EMULATE)
        if scheduled is None:
            return None
        return scheduled.with_attr(FLOPS_ATTR, int(estimate_tir_flops(tvm.IRModule({"main": func}))))


def uses_amx(mod: tvm.IRModule) -> bool:
    """Whether a scheduled module has kernels on the tile units (its process must ask for the tile state)."""
    return any(isinstance(f, tirx.PrimFunc) and f.attrs and bool(f.attrs.get(AMX_ATTR, False))
               for _, f in mod.functions_items())

