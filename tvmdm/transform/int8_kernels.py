"""TE kernel builders of the int8 rewrite and the block names schedules.int8 looks for (the contract between
tvmdm.transform.quantized and schedules.int8).

  int8_gemm        acc (int32) = sum_k a[.., k] (uint8) * W[k, n] (int8), W packed once at compile for the
                   CPU's integer dot product (``Int8Packing``):
                     VNNI   [N/16, K/4, 16, 4] int8: per 16 output columns, the quads of consecutive k that one
                            vpdpbusd (16 int32 lanes, each the sum of 4 u8 x s8 products) reads as one vector;
                     BYTE_PAIRS [N/8, K/4, 8, 4] int8 (AVX2 without VNNI): vpmaddubsw's 32 bytes (8 int32
                            lanes after a vpmaddwd by ones), K's rows in an order under which its int16 pair sums
                            cannot saturate (tvmdm.transform.saturation_free);
                     WIDE   [N/8, K/2, 8, 2] int16 (AVX2, weights with no such order): the pairs one vpmaddwd reads (8 lanes,
                            each the sum of 2 int16 products: exact for u8 x s8, where vpmaddubsw saturates);
                            the activations arrive widened to int16 too (by the kernel that quantizes them), so
                            a pair is one broadcast load, not a load, a widening and a shuffle per row;
  int8_zero_point  C = acc - zero_point(a) * colsum(W): the activations' zero point folded out of the loop (the
                   weight's column sums are computed with the packing), so the contraction reads the uint8 values
                   as they are; it is the epilogue every dequantize (scale multiply, bias, GELU) fuses after.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from tvm import te, tirx

from tvmdm.transform.kernels import int64_dims, lead_dims, private_func, row_tiles, tile_operand

INT8_GEMM_BLOCK = "int8_gemm"
INT8_ZERO_POINT_BLOCK = "int8_zero_point"
REORDER_BLOCK = "reorder_k"


@dataclasses.dataclass(frozen=True)
class Int8Packing:
    """The weight layout [N/lanes, K/group, lanes, group] of ``dtype``: ``group`` products per accumulator;
    the kernel reads the activations (uint8 values) as ``activations``."""
    lanes: int
    group: int
    dtype: str
    activations: str = "uint8"

    def fits(self, k: int, n: int) -> bool:
        return n % self.lanes == 0 and k % self.group == 0

    def shape(self, k: int, n: int) -> list[int]:
        return [n // self.lanes, k // self.group, self.lanes, self.group]

    def pack(self, w: np.ndarray) -> np.ndarray:
        """W [K, N] int8 -> this layout (see the module doc)."""
        k, n = w.shape
        grouped = w.reshape(k // self.group, self.group, n // self.lanes, self.lanes).transpose(2, 0, 3, 1)
        return np.ascontiguousarray(grouped.astype(self.dtype))


VNNI = Int8Packing(16, 4, "int8")  # vpdpbusd (and the AMX-INT8 tile rows)
BYTE_PAIRS = Int8Packing(8, 4, "int8")  # vpmaddubsw + vpmaddwd on AVX2, K in a saturation-free order
WIDE = Int8Packing(8, 2, "int16", "int16")  # vpmaddwd on AVX2 (exact for any weights)


def reorder_func(lead, k: int, dtype: str) -> tirx.PrimFunc:
    """y[..., j] = x[..., order[j]] (order: int32 [K]): activations in a BYTE_PAIRS contraction's K order. An
    injective kernel (Relax's take is opaque), so the quantization producing x fuses into it."""
    lead = lead_dims(lead)
    x = te.placeholder(lead + int64_dims((k,)), dtype, name="x")
    order = te.placeholder(int64_dims((k,)), "int32", name="order")
    y = te.compute(x.shape, lambda *idx: x(*idx[:-1], order(idx[-1]).astype("int64")), name=REORDER_BLOCK)
    return private_func(te.create_prim_func([x, order, y])).with_attr("op_pattern", 2)


def column_sums(w: np.ndarray) -> np.ndarray:
    """sum_k W[k, n] as int32: what the activations' zero point contributes to each output column."""
    return w.astype(np.int32).sum(axis=0, dtype=np.int32)


def int8_gemm_func(lead, k: int, n: int, packing: Int8Packing = VNNI, padded: bool = False) -> tirx.PrimFunc:
    """C[lead..., N] (int32) = sum_k (a[lead..., k] - zero_point) * W[k, n] from a (uint8 values in the
    packing's activation dtype), its zero point (a uint8 scalar), W packed as ``packing`` says and W's column
    sums (int32 [N]). Symbolic rows are computed in whole tiles (kernels.row_tiles); ``padded``: a holds them
    padded to whole tiles of TILE_ROW_PAD (kernels.pad_rows_func), read in place by the AMX tiles."""
    lead = lead_dims(lead)
    lanes, group = packing.lanes, packing.group
    a_lead, operand_rows, pad = tile_operand(lead, padded)
    a = te.placeholder(a_lead + int64_dims((k,)), packing.activations, name="a")
    zero_point = te.placeholder((), "uint8", name="zero_point")
    w = te.placeholder(int64_dims(packing.shape(k, n)), packing.dtype, name="w")
    sums = te.placeholder(int64_dims((n,)), "int32", name="column_sums")
    r = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", k)), name="k")

    def element(*idx):
        *lead_idx, col = idx
        return te.sum(a(*operand_rows(lead_idx), r).astype("int32") *
                      w(col // lanes, r // group, col % lanes, r % group).astype("int32"), axis=r)

    def finish(acc, idx):
        return acc(*idx) - zero_point().astype("int32") * sums(idx[-1])

    out = row_tiles(lead, n, element, INT8_GEMM_BLOCK, INT8_ZERO_POINT_BLOCK, finish, pad)
    # the dequantize (scale multiply) and bias / GELU / residual epilogues fuse after it
    return private_func(te.create_prim_func([a, zero_point, w, sums, out])).with_attr("op_pattern", 4)
