"""int8 contractions: quantized models' integer matmuls on packed int8 weights.

``int8_contractions()`` is a Relax pass on the imported graph (before lowering). onnxruntime's dynamic
quantization (``quantize_dynamic``, QInt8 weights) writes each weight contraction as DynamicQuantizeLinear on
the activations and MatMulInteger against an int8 initializer; TVM's ONNX frontend imports MatMulInteger as

    matmul(astype(x_q, int32) - astype(x_zp, int32), astype(W, int32) - astype(w_zp, int32), out_dtype=int32)

with x_q uint8 [..., K], x_zp a uint8 scalar, W an int8 constant [K, N] and w_zp an int8 constant. Where w_zp
is 0 (quantize_dynamic's symmetric int8 weights) this becomes one ``int8_gemm`` kernel (tvmdm.transform.
int8_kernels) reading x_q as it is, W packed at compile time as [N/16, K/4, 16, 4] with its column sums (the
zero point's term), so schedules.int8 runs it on the integer dot product (vpdpbusd) where the CPU has one.
The dequantize after it (the int32 -> fp32 cast, the scale multiply, the bias) fuses into its epilogue.

Preconditions: shapes of W and the last dim of x_q concrete (the leading dims may be symbolic); N % 16 == 0 and
K % 4 == 0. A contraction that does not match (a nonzero or per-column weight zero point, a weight computed at
run time) keeps the frontend's generic int32 matmul: same results, slower.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax, tirx

from tvmdm.transform.int8_kernels import column_sums, int8_fits, int8_gemm_func, pack_int8_weight
from tvmdm.transform.ir import bindings_of, call_op, function_pass, rewritten


@dataclasses.dataclass(frozen=True)
class Int8Gemm:
    """matmul of x (uint8, its zero point ``zero_point``) by the int8 constant ``weight`` ([K, N])."""
    x: relax.Expr
    zero_point: relax.Expr
    weight: np.ndarray


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


def _plan(func: relax.Function) -> dict:
    """var -> Int8Gemm for every integer matmul the rewrite takes (see the module doc)."""
    bindings = bindings_of(func)
    targets = {}
    for var, value in bindings.items():
        if call_op(value) != "relax.matmul" or str(value.attrs.out_dtype) != "int32":
            continue
        left, right = (_widened(arg, bindings, dtype) for arg, dtype in zip(value.args, ("uint8", "int8")))
        if left is None or right is None or left[1] is None:
            continue
        (x, x_zp), (w, w_zp) = left, right
        weight = _constant(w, bindings)
        w_zero = np.zeros((), np.int8) if w_zp is None else _constant(w_zp, bindings)
        dims = x.ty.shape.values
        if weight is None or weight.ndim != 2 or w_zero is None or np.any(w_zero != 0) or \
                len(x_zp.ty.shape.values) != 0 or not isinstance(dims[-1], tirx.IntImm) or \
                not int8_fits(*weight.shape):
            continue
        targets[var] = Int8Gemm(x, x_zp, weight)
    return targets


def int8_contractions() -> tvm.transform.Pass:
    """matmul(x_q - x_zp, W - 0) of a quantized model -> int8_gemm(x_q, x_zp, pack(W), colsum(W)) in every Relax
    function; see the module doc. A model without such contractions is returned unchanged."""
    return function_pass("tvmdm.Int8Contractions", _rewrite_function)


def _rewrite_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    targets = _plan(mod[name])
    if not targets:
        return mod

    @relax.expr_functor.mutator
    class ToInt8(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            target = targets.get(binding.var)
            if target is None:
                return super().visit_var_binding_(binding)
            k, n = target.weight.shape
            lead = list(target.x.ty.shape.values)[:-1]
            gemm = self.builder_.add_func(int8_gemm_func(lead, k, n), "int8_gemm")
            args = [self.visit_expr(target.x), self.visit_expr(target.zero_point),
                    relax.const(pack_int8_weight(target.weight)), relax.const(column_sums(target.weight))]
            out = self.builder_.emit(relax.call_tir(gemm, args, relax.TensorType(lead + [n], "int32")))
            self.set_var_remap(binding.var, out)
            return None

    return rewritten(mod, name, ToInt8(mod))
