"""TE kernel builders of the int8 rewrite and the block names schedules.int8 looks for (the contract between
tvmdm.transform.quantized and schedules.int8).

  int8_gemm        acc (int32) = sum_k a[.., k] (uint8) * W[k, n] (int8), W packed once at compile as
                   [N/16, K/4, 16, 4]: for each 16 output columns, the quads of consecutive k that one integer
                   dot product (vpdpbusd: 16 int32 lanes, each the sum of 4 u8 x s8 products) reads as one vector;
  int8_zero_point  C = acc - zero_point(a) * colsum(W): the activations' zero point folded out of the loop (the
                   weight's column sums are computed with the packing), so the contraction reads the uint8 values
                   as they are; it is the epilogue every dequantize (scale multiply, bias, GELU) fuses after.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from tvmdm.transform.kernels import clamped_rows, int64_dims, lead_dims, private_func, row_tiles

INT8_GEMM_BLOCK = "int8_gemm"
INT8_ZERO_POINT_BLOCK = "int8_zero_point"
INT8_LANES = 16  # int32 accumulators per vpdpbusd (and per AMX tile row)
QUAD = 4  # u8 x s8 products per accumulator per vpdpbusd


def int8_fits(k: int, n: int) -> bool:
    return n % INT8_LANES == 0 and k % QUAD == 0


def int8_packed_shape(k: int, n: int) -> list[int]:
    return [n // INT8_LANES, k // QUAD, INT8_LANES, QUAD]


def pack_int8_weight(w: np.ndarray) -> np.ndarray:
    """W [K, N] int8 -> [N/16, K/4, 16, 4] (see the module doc)."""
    k, n = w.shape
    return np.ascontiguousarray(w.reshape(k // QUAD, QUAD, n // INT8_LANES, INT8_LANES).transpose(2, 0, 3, 1))


def column_sums(w: np.ndarray) -> np.ndarray:
    """sum_k W[k, n] as int32: what the activations' zero point contributes to each output column."""
    return w.astype(np.int32).sum(axis=0, dtype=np.int32)


def int8_gemm_func(lead, k: int, n: int) -> tirx.PrimFunc:
    """C[lead..., N] (int32) = sum_k (a[lead..., k] - zero_point) * W[k, n] from a (uint8), its zero point (a
    uint8 scalar), W packed ([N/16, K/4, 16, 4] int8) and W's column sums (int32 [N]). Symbolic rows are
    computed in whole tiles (kernels.row_tiles)."""
    lead = lead_dims(lead)
    a = te.placeholder(lead + int64_dims((k,)), "uint8", name="a")
    zero_point = te.placeholder((), "uint8", name="zero_point")
    w = te.placeholder(int64_dims(int8_packed_shape(k, n)), "int8", name="w")
    sums = te.placeholder(int64_dims((n,)), "int32", name="column_sums")
    r = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", k)), name="k")

    def element(*idx):
        *lead_idx, col = idx
        return te.sum(a(*clamped_rows(lead_idx, lead), r).astype("int32") *
                      w(col // INT8_LANES, r // QUAD, col % INT8_LANES, r % QUAD).astype("int32"), axis=r)

    def finish(acc, idx):
        return acc(*idx) - zero_point().astype("int32") * sums(idx[-1])

    out = row_tiles(lead, n, element, INT8_GEMM_BLOCK, INT8_ZERO_POINT_BLOCK, finish)
    # the dequantize (scale multiply) and bias / GELU / residual epilogues fuse after it
    return private_func(te.create_prim_func([a, zero_point, w, sums, out])).with_attr("op_pattern", 4)
