"""TE kernel builders the precision rewrites emit, and the block names the schedules look for (the contract
between tvmdm.transform.precision and schedules.bf16 / schedules.packed).

  to_bf16      x (fp32) -> its bf16 bits (uint16, round to nearest even);
  pack_bf16    W (fp32 [K, N]) -> bf16 bits packed as [N/16, K/2, 16, 2] (one vdpbf16ps operand per k pair);
  bf16_gemm    C (fp32) = sum_k bf16(x) * bf16(W);
and their fp32 twins on packed panels (packed_gemm, pack_weight, transpose_rows) for schedules.packed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from tvm import te, tirx

GEMM_BLOCK = "bf16_gemm"  # the contraction block schedules.bf16 looks for
TRANSPOSED_BLOCK = "to_bf16_t"  # the transposing conversion (weight gradients' left operand), scheduled there too
LANES = 16  # fp32 accumulators per vdpbf16ps
PAIR = 2  # bf16 values per accumulator per vdpbf16ps
BITS = "uint16"
ROW_PAD = 8  # symbolic rows are computed in whole tiles of this many (a multiple of schedules.packed.ROWS)
# operands of symbolic rows that the AMX tiles read (bf16 bits; int8 activations on AMX-INT8) come padded to
# whole tiles of this many (the AMX block rows, schedules.amx.BLOCK), so that the tile loads never read past them
TILE_ROW_PAD = 32
FP32_GEMM_BLOCK = "packed_gemm"  # fp32 contraction on packed weights (schedules.packed)
FP32_PACK_BLOCK = "pack_weight"  # its weight packing
TRANSPOSED_ROWS_BLOCK = "transpose_rows"  # X^T of its weight gradients


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a rewritten contraction stores its operands: the weight packed as [N/lanes, K/pair, lanes, pair]
    (each ``lanes`` output columns' panel contiguous over K), values in ``dtype`` written by ``encode`` and read
    back as fp32 by ``decode``; the contraction's block is named ``block``, the weight packing's ``pack_name``,
    the weight gradients' transposed X ``transposed_name``."""
    block: str
    dtype: str
    lanes: int
    pair: int
    encode: Callable
    decode: Callable
    pack_name: str
    transposed_name: str

    def fits(self, k: int, n: int) -> bool:
        return n % self.lanes == 0 and k % self.pair == 0

    @property
    def converts(self) -> bool:
        """Whether activations are converted before the contraction reads them (not when they stay fp32)."""
        return self.dtype != "float32"


BF16 = Packing(GEMM_BLOCK, BITS, LANES, PAIR, lambda v: bf16_bits(v), lambda v: bf16_value(v), "pack_bf16",
               TRANSPOSED_BLOCK)


def fp32_packing(lanes: int) -> Packing:
    """fp32 operands, weights in panels of ``lanes`` columns (schedules.packed's micro-kernel reads one panel
    row per k as a few vectors, contiguous instead of a weight row apart)."""
    return Packing(FP32_GEMM_BLOCK, "float32", lanes, 1, lambda v: v, lambda v: v, FP32_PACK_BLOCK,
                   TRANSPOSED_ROWS_BLOCK)


def bf16_bits(value):
    """fp32 expression -> its bf16 bits (round to nearest, ties to even), as uint16."""
    bits = tirx.reinterpret("uint32", value)
    rounded = bits + tirx.const(0x7FFF, "uint32") + ((bits >> tirx.const(16, "uint32")) & tirx.const(1, "uint32"))
    return (rounded >> tirx.const(16, "uint32")).astype(BITS)


def bf16_value(bits):
    """bf16 bits (uint16) -> the fp32 value they encode (exact)."""
    return tirx.reinterpret("float32", bits.astype("uint32") << tirx.const(16, "uint32"))


def int64_dims(dims) -> tuple:
    """Shapes as int64, as LegalizeOps writes them (FuseTIR refuses to join buffers whose shapes differ in type)."""
    return tuple(tirx.IntImm("int64", int(d)) for d in dims)


def lead_dims(lead) -> tuple:
    """A kernel's leading (row) dims: concrete ones as int64, each symbolic one (a Relax function's batch or seq)
    as a fresh int64 var of the kernel's own, defined by its input buffer's shape."""
    return tuple(tirx.IntImm("int64", int(d)) if isinstance(d, (int, tirx.IntImm)) else
                 tirx.Var(getattr(d, "name", "n"), "int64") for d in lead)


def to_bf16_func(shape) -> tirx.PrimFunc:
    """x (fp32) -> its bf16 bits. Symbolic rows (the last leading dim): the output holds them padded to whole
    tiles of TILE_ROW_PAD (padded_rows), the rows past the end copies of the last one, so that a contraction
    reads whole tiles of it in place (gemm_func)."""
    return private_func(_rows_padded(shape, "float32", bf16_bits, "to_bf16"))


def pad_rows_func(shape, dtype: str) -> tirx.PrimFunc:
    """x [lead..., rows, K] of symbolic rows -> x with its rows padded to whole tiles of TILE_ROW_PAD, the rows
    past the end copies of the last one (what to_bf16_func writes, for operands that need no conversion: int8
    activations). Injective, so the element-wise kernel producing x (a quantization) fuses into it."""
    return private_func(_rows_padded(shape, dtype, lambda value: value, "pad_rows")).with_attr("op_pattern", 2)


def _rows_padded(shape, dtype: str, convert, name: str) -> tirx.PrimFunc:
    """y = convert(x) for x [lead..., K] of ``dtype``, symbolic rows padded to whole tiles of TILE_ROW_PAD with
    copies of the last row (converted_shape)."""
    *lead, k = shape
    lead = lead_dims(lead)
    x = te.placeholder(lead + int64_dims((k,)), dtype, name="x")
    out = te.compute(converted_shape(lead + int64_dims((k,))),
                     lambda *i: convert(x(*clamped_rows(i[:-1], lead), i[-1])), name=name)
    return te.create_prim_func([x, out])


def tile_operand(lead, padded: bool):
    """(the leading dims of a contraction's left operand, the operand's index of an output row, the rows of a
    tile) for a contraction of rows ``lead``: read in place from rows padded to whole tiles of TILE_ROW_PAD
    where ``padded`` and the rows are symbolic (to_bf16_func, pad_rows_func), else through clamped_rows."""
    if not padded or isinstance(lead[-1], tirx.IntImm):
        return lead, lambda lead_idx: clamped_rows(lead_idx, lead), ROW_PAD
    return lead[:-1] + (tirx.Var("rows_padded", "int64"),), list, TILE_ROW_PAD


def converted_shape(shape) -> list:
    """The shape of x's bf16 bits (to_bf16_func) for x of ``shape``: symbolic rows (the last leading dim) padded
    to whole tiles of TILE_ROW_PAD."""
    *lead, k = shape
    if all(isinstance(d, (int, tirx.IntImm)) for d in lead):
        return list(shape)
    return [*lead[:-1], padded_rows(lead[-1], TILE_ROW_PAD), k]


def padded_rows(rows, pad: int = ROW_PAD):
    """``rows`` rounded up to whole tiles of ``pad``."""
    return (rows + pad - 1) // pad * pad


def private_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """No global_symbol, like LegalizeOps' kernels: dead-code elimination may drop it once fused."""
    return func.without_attr("global_symbol") if func.attrs and "global_symbol" in func.attrs else func


def packed_shape(k: int, n: int, packing: Packing = BF16) -> list[int]:
    return [n // packing.lanes, k // packing.pair, packing.lanes, packing.pair]


def pack_weight_func(k: int, n: int, transposed: bool, batch=(), packing: Packing = BF16) -> tirx.PrimFunc:
    """W [batch..., K, N] (or [batch..., N, K] when ``transposed``) -> ``packing``'s layout (bf16: bits as
    [batch..., N/16, K/2, 16, 2])."""
    batch = tuple(batch)
    w = te.placeholder(int64_dims(batch + ((n, k) if transposed else (k, n))), "float32", name="w")

    def element(*idx):
        *b, no, ko, ni, ki = idx
        row, col = ko * packing.pair + ki, no * packing.lanes + ni
        return packing.encode(w(*b, col, row) if transposed else w(*b, row, col))

    out = te.compute(int64_dims(batch + tuple(packed_shape(k, n, packing))), element, name=packing.pack_name)
    return private_func(te.create_prim_func([w, out]))


def gemm_func(lead, k: int, n: int, batch: int = 0, packing: Packing = BF16) -> tirx.PrimFunc:
    """C[lead..., N] (fp32) = A[lead..., K] x packed W, both stored as ``packing`` says (bf16 bits by default),
    block ``packing.block``. With ``batch`` > 0, W has the first ``batch`` dims of ``lead`` in front (batched
    contractions: attention)."""
    lanes, pair, decode = packing.lanes, packing.pair, packing.decode
    lead = lead_dims(lead)
    # converted symbolic rows come padded (to_bf16_func): read in place, whole tiles of TILE_ROW_PAD
    a_lead, operand_rows, pad = tile_operand(lead, packing.converts)
    a = te.placeholder(a_lead + int64_dims((k,)), packing.dtype, name="a")
    w = te.placeholder(lead[:batch] + int64_dims(packed_shape(k, n, packing)), packing.dtype, name="w")
    r = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", k)), name="k")

    def element(*idx):
        *lead_idx, col = idx
        return te.sum(decode(a(*operand_rows(lead_idx), r)) *
                      decode(w(*lead_idx[:batch], col // lanes, r // pair, col % lanes, r % pair)), axis=r)

    out = row_tiles(lead, n, element, packing.block, pad=pad)
    # A contraction with element-wise epilogues: FuseOps may fuse bias / GELU / residual after it.
    return private_func(te.create_prim_func([a, w, out])).with_attr("op_pattern", 4)


def clamped_rows(lead_idx, lead) -> list:
    """The activation index of a row of ``row_tiles``: past the last row of symbolic rows, the last row again."""
    rows = lead[-1]
    return list(lead_idx) if isinstance(rows, tirx.IntImm) else list(lead_idx[:-1]) + [tirx.min(lead_idx[-1], rows - 1)]


def row_tiles(lead, n: int, element, name: str, rows_name: str | None = None, finish=lambda tiles, idx: tiles(*idx),
              pad: int = ROW_PAD):
    """C[lead..., N] = ``element(*idx)`` (a contraction reading its rows through clamped_rows), block ``name``;
    ``finish(tiles, idx)`` computes each output from the contraction (the copy out, or an epilogue of the kernel's
    own) in block ``rows_name`` (default: none for static rows, ``name`` + "_rows" for symbolic rows).

    Symbolic rows (one module for every seq): the contraction runs over whole tiles of ``pad`` rows, the rows
    past the end re-reading the last one, into a buffer the schedule keeps in registers; only the copy out is
    guarded. A predicated tile instead made the accumulators a heap buffer of symbolic size (3x slower,
    BERT-base FFN)."""
    rows = lead[-1]
    if isinstance(rows, tirx.IntImm):
        tiles = te.compute(lead + int64_dims((n,)), element, name=name)
        return tiles if rows_name is None else te.compute(tiles.shape, lambda *idx: finish(tiles, idx),
                                                          name=rows_name)
    tiles = te.compute(lead[:-1] + (padded_rows(rows, pad),) + int64_dims((n,)), element, name=name)
    return te.compute(lead + int64_dims((n,)), lambda *idx: finish(tiles, idx), name=rows_name or name + "_rows")


def transposed_rows_func(shape, packing: Packing = BF16) -> tirx.PrimFunc:
    """x [lead..., K] (fp32) -> x^T as [K, rows] (rows = the leading dims flattened) stored as ``packing`` says
    (bf16 bits by default): the left operand of a weight gradient, X^T dY. For a 2-D x it is a plain
    transpose, which schedules.transposes tiles when the values stay fp32."""
    *lead, k = shape
    rows = int(np.prod(lead))
    x = te.placeholder(int64_dims(shape), "float32", name="x")

    def element(col, row):
        if len(lead) == 1:
            return packing.encode(x(row, col))
        index, rest = [], row
        for d in reversed(lead):
            index.append(rest % d)
            rest = rest // d
        return packing.encode(x(*reversed(index), col))

    out = te.compute(int64_dims((k, rows)), element, name=packing.transposed_name)
    return private_func(te.create_prim_func([x, out]))
