"""int8 contractions: quantized models' integer matmuls on packed int8 weights.

``int8_contractions()`` is a Relax pass on the imported graph (before lowering). onnxruntime's dynamic
quantization (``quantize_dynamic``, QInt8 weights) writes each weight contraction as DynamicQuantizeLinear on
the activations and MatMulInteger against an int8 initializer; TVM's ONNX frontend imports MatMulInteger as

    matmul(astype(x_q, int32) - astype(x_zp, int32), astype(W, int32) - astype(w_zp, int32), out_dtype=int32)

with x_q uint8 [..., K], x_zp a uint8 scalar, W an int8 constant [K, N] and w_zp an int8 constant. Where w_zp
is 0 (quantize_dynamic's symmetric int8 weights) this becomes one ``int8_gemm`` kernel (tvmdm.transform.
int8_kernels) reading x_q as it is, W packed at compile time for the CPU's integer dot product (vpdpbusd's
[N/16, K/4, 16, 4] int8; without VNNI vpmaddubsw's [N/8, K/4, 8, 4] int8 with K in a saturation-free order,
x_q taken in that order by the kernel that quantizes it, or vpmaddwd's exact [N/8, K/2, 8, 2] int16 with x_q
widened to int16 where no such order exists; with AVX-VNNI the same [N/8, K/4, 8, 4] in the stored order,
for vpdpbusd on 256-bit registers) with its column sums (the zero point's term), for
schedules.int8's micro-kernels.
The dequantize after it (the int32 -> fp32 cast, the scale multiply, the bias) fuses into its epilogue.

QDQ files (static quantization and other tools: QuantizeLinear / DequantizeLinear around a float MatMul) import
as ``matmul(dequantize(x_q, s_x, x_zp), dequantize(W, s_w, 0))``: the same kernel, then the cast and the
multiply by s_x * s_w (per tensor or per output column). int8 activations (QDQ's default) are read as uint8
with 128 added to them and to their zero point (x_q - x_zp is unchanged; vpdpbusd multiplies unsigned by
signed bytes), an element-wise step that fuses into the quantization producing them.

Preconditions: shapes of W and the last dim of x_q concrete (the leading dims may be symbolic); N and K whole
panels of the packing (VNNI: N % 16 == 0 and K % 4 == 0; AVX2: N % 8, K % 4 or else K % 2); zero points scalars. A
contraction that does not match (a nonzero weight zero point, a weight computed at run time) keeps the
frontend's generic int32 or float matmul: same results, slower.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax, tirx

from tvmdm.transform.int8_kernels import (BYTE_PAIRS, VNNI, WIDE, Int8Packing, column_sums, int8_gemm_func,
                                          reorder_func)
from tvmdm.transform.kernels import converted_shape, pad_rows_func
from tvmdm.transform.saturation_free import saturation_free_order
from tvmdm.transform.ir import bindings_of, call_op, function_pass, rewritten


@dataclasses.dataclass(frozen=True)
class Int8Gemm:
    """matmul of x (uint8 or int8, its zero point ``zero_point``) by the int8 constant ``weight`` ([K, N]);
    ``scale`` (QDQ): the dequantize scales' product the integer result is multiplied by, None where the
    graph multiplies it itself (MatMulInteger)."""
    x: relax.Expr
    zero_point: relax.Expr
    weight: np.ndarray
    scale: tuple | None = None  # (s_x, s_w)
    packing: Int8Packing = VNNI
    order: np.ndarray | None = dataclasses.field(default=None, compare=False)  # K's order (BYTE_PAIRS)


def _widened(expr, bindings: dict, dtype: str):
    """(source, zero point or None) when ``expr`` is astype(source of ``dtype``, int32), minus astype(zero
    point, int32) or not; else None."""
    value = bindings.get(expr) if isinstance(expr, relax.Var) else expr
    zero_point = None
    if call_op(value) == "relax.subtract":
        expr, zp_expr = value.args
        zp_value = bindings.get(zp_expr) if isinstance(zp_expr, relax.Var) else zp_expr
        if call_op(zp_value) != "relax.astype" or zp_value.args[0].ty.dtype != dtype:
            return None
        zero_point = zp_value.args[0]
        value = bindings.get(expr) if isinstance(expr, relax.Var) else expr
    if call_op(value) != "relax.astype" or str(value.attrs.dtype) != "int32" or value.args[0].ty.dtype != dtype:
        return None
    return value.args[0], zero_point


def _constant(expr, bindings: dict) -> np.ndarray | None:
    while isinstance(expr, relax.Var) and expr in bindings:
        expr = bindings[expr]
    return expr.value.numpy() if isinstance(expr, tvm.ir.expr.Constant) else None


def _dequantized(expr, bindings: dict, per_column: bool = False):
    """(data, scale, zero point) when ``expr`` is dequantize(data, scale, zero point) to float32 with a scalar
    scale (``per_column``: or one per column of a 2-D data), else None."""
    value = bindings.get(expr) if isinstance(expr, relax.Var) else expr
    if call_op(value) != "relax.dequantize" or str(value.attrs.out_dtype) != "float32":
        return None
    scale_rank = len(value.args[1].ty.shape.values)
    if scale_rank > 1 or scale_rank == 1 and not (per_column and int(value.attrs.axis) in (1, -1)):
        return None
    return tuple(value.args)


def _int8_gemm(x, x_zp, w, w_zp, bindings: dict, packing: Int8Packing, scale=None) -> Int8Gemm | None:
    """The plan of x (int8 / uint8 activations, a scalar zero point) times the weight ``w``, when ``w`` is a 2-D
    int8 constant of whole panels with zero point 0; else None."""
    weight = _constant(w, bindings)
    w_zero = np.zeros((), np.int8) if w_zp is None else _constant(w_zp, bindings)
    dims = x.ty.shape.values
    if weight is None or weight.dtype != np.int8 or weight.ndim != 2 or w_zero is None or np.any(w_zero != 0) \
            or x.ty.dtype not in ("uint8", "int8") or x_zp.ty.dtype != x.ty.dtype or \
            len(x_zp.ty.shape.values) != 0 or not isinstance(dims[-1], tirx.IntImm) or not packing.fits(*weight.shape):
        return None
    return Int8Gemm(x, x_zp, weight, scale)


def _plan(func: relax.Function, packing: Int8Packing) -> dict:
    """var -> Int8Gemm for every quantized matmul the rewrite takes (see the module doc)."""
    bindings = bindings_of(func)
    targets = {}
    for var, value in bindings.items():
        if call_op(value) != "relax.matmul":
            continue
        plan = None
        if str(value.attrs.out_dtype) == "int32":  # MatMulInteger
            x, w = value.args
            left = _widened(x, bindings, "uint8") or _widened(x, bindings, "int8")
            right = _widened(w, bindings, "int8")
            if left is not None and right is not None and left[1] is not None:
                plan = _int8_gemm(*left, *right, bindings, packing)
        else:  # QDQ
            left, right = _dequantized(value.args[0], bindings), _dequantized(value.args[1], bindings, True)
            if left is not None and right is not None:
                plan = _int8_gemm(left[0], left[2], right[0], right[2], bindings, packing, scale=(left[1], right[1]))
        if plan is not None:
            targets[var] = plan
    return targets


def int8_contractions(vnni: bool = True, avx_vnni: bool = False, tiles: bool = False) -> tvm.transform.Pass:
    """matmul(x_q - x_zp, W - 0) of a quantized model (or its QDQ form) -> int8_gemm(x_q, x_zp, pack(W), colsum(W))
    in every Relax function; see the module doc. ``vnni=False`` (a CPU without AVX512-VNNI): with ``avx_vnni``
    (AVX-VNNI: vpdpbusd on 256-bit registers) the weights packed as BYTE_PAIRS in their own order, which
    vpdpbusd reads without saturating; without it (AVX2) packed for vpmaddubsw with K in a saturation-free
    order (tvmdm.transform.saturation_free; the activations taken in that order), or for vpmaddwd (int16 pairs,
    exact, slower) where no such order is found. ``tiles`` (AMX-INT8, with vnni): activations of symbolic rows
    padded to whole tiles of TILE_ROW_PAD (kernels.pad_rows_func, into which their quantization fuses) for the
    tile kernel to read in place. A model without such contractions is returned unchanged."""
    return function_pass("tvmdm.Int8Contractions",
                         lambda mod, name: _rewrite_function(mod, name, vnni, avx_vnni, tiles))


def _byte_pairs_or_wide(targets: dict) -> dict:
    """AVX2's plans: per activation source (Q, K and V share theirs) one K order for all its weights on
    vpmaddubsw (BYTE_PAIRS), or vpmaddwd (WIDE) for all of them where there is none."""
    sources: dict = {}
    for var, target in targets.items():
        sources.setdefault(target.x, []).append(var)
    chosen = {}
    for users in sources.values():
        weights = [targets[var].weight for var in users]
        order = None
        if all(BYTE_PAIRS.fits(*w.shape) for w in weights):
            order = saturation_free_order(np.concatenate(weights, axis=1))
        for var in users:
            chosen[var] = dataclasses.replace(targets[var], packing=BYTE_PAIRS if order is not None else WIDE,
                                              order=order)
    return chosen


def _byte_pairs_as_stored(targets: dict) -> dict:
    """AVX-VNNI's plans: BYTE_PAIRS in the weights' own order (vpdpbusd adds its four products into int32:
    nothing saturates) wherever K is whole quads, else WIDE."""
    return {var: dataclasses.replace(target, packing=BYTE_PAIRS) if BYTE_PAIRS.fits(*target.weight.shape)
            else target for var, target in targets.items()}


def _rewrite_function(mod: tvm.IRModule, name: str, vnni: bool, avx_vnni: bool, tiles: bool) -> tvm.IRModule:
    targets = _plan(mod[name], VNNI if vnni else WIDE)
    if not targets:
        return mod
    if not vnni:
        targets = _byte_pairs_as_stored(targets) if avx_vnni else _byte_pairs_or_wide(targets)

    @relax.expr_functor.mutator
    class ToInt8(relax.PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.activations = {}  # source var -> as the kernels of its plans read it (one per source)

        def _activations(self, target: Int8Gemm) -> relax.Expr:
            if target.x not in self.activations:
                bb, x = self.builder_, self.visit_expr(target.x)
                if x.ty.dtype == "int8":
                    x = bb.emit(_as_uint8(x))
                if target.order is not None:
                    reorder = bb.add_func(reorder_func(x.ty.shape.values[:-1], len(target.order), x.ty.dtype),
                                          "reorder_k")
                    x = bb.emit(relax.call_tir(reorder, [x, relax.const(target.order.astype(np.int32))], x.ty))
                if target.packing.activations != x.ty.dtype:
                    x = bb.emit(relax.op.astype(x, target.packing.activations))
                if self._padded(target):
                    pad = bb.add_func(pad_rows_func(x.ty.shape.values, x.ty.dtype), "pad_rows")
                    x = bb.emit(relax.call_tir(pad, [x], relax.TensorType(
                        converted_shape(x.ty.shape.values), x.ty.dtype)))
                self.activations[target.x] = x
            return self.activations[target.x]

        @staticmethod
        def _padded(target: Int8Gemm) -> bool:
            return tiles and target.packing is VNNI and not isinstance(target.x.ty.shape.values[-2], tirx.IntImm)

        def visit_var_binding_(self, binding):
            target = targets.get(binding.var)
            if target is None:
                return super().visit_var_binding_(binding)
            bb, packing = self.builder_, target.packing
            k, n = target.weight.shape
            lead = list(target.x.ty.shape.values)[:-1]
            zero_point = self.visit_expr(target.zero_point)
            if zero_point.ty.dtype == "int8":
                zero_point = bb.emit(_as_uint8(zero_point))
            weight = target.weight if target.order is None else target.weight[target.order]
            gemm = bb.add_func(int8_gemm_func(lead, k, n, packing, self._padded(target)), "int8_gemm")
            args = [self._activations(target), zero_point, relax.const(packing.pack(weight)),
                    relax.const(column_sums(weight))]
            out = bb.emit(relax.call_tir(gemm, args, relax.TensorType(lead + [n], "int32")))
            if target.scale is not None:  # QDQ: the dequantize of the product
                x_scale, w_scale = (self.visit_expr(v) for v in target.scale)
                out = bb.emit(relax.op.multiply(relax.op.astype(out, "float32"), relax.op.multiply(x_scale, w_scale)))
            self.set_var_remap(binding.var, out)
            return None

    return rewritten(mod, name, ToInt8(mod))


def _as_uint8(value: relax.Expr) -> relax.Expr:
    """int8 values as uint8 + 128 (applied to activations and their zero point: the difference is unchanged)."""
    return relax.op.astype(relax.op.add(relax.op.astype(value, "int32"), relax.const(128, "int32")), "uint8")
