"""Mixed precision: the weight contractions read bf16 operands and accumulate in fp32.

``bf16_contractions()`` is a Relax pass on the imported graph (before lowering). Each ``matmul(x, W)`` whose
right operand is a 2-D weight (a parameter, or its transpose) becomes three kernels:

  to_bf16      x (fp32) -> its bf16 bits (uint16, round to nearest even); an element-wise kernel that FuseOps
               may fuse into x's producer;
  pack_bf16    W (fp32 [K, N]) -> bf16 bits packed as [N/16, K/2, 16, 2]: for each 16 output columns, the
               pairs of consecutive k that one AVX512-BF16 dot product (vdpbf16ps) reads as one vector. It only
               depends on the weight, so LiftTransformParams moves it to main_transform_params (run once at
               load);
  bf16_gemm    C (fp32) = sum_k bf16(x) * bf16(W): its block is scheduled by schedules.bf16 with the
               vdpbf16ps micro-kernel; bias / GELU / residual epilogues that FuseOps fuses into it stay fp32.

The attention's batched contractions ([B, h, S, d] x [B, h, d, S] and back) take the same kernels with their
right operand packed per call; under fusion="paper" they are einsums and stay fp32. Everything else
(LayerNorm, softmax and its statistics, residual sums, model inputs and outputs) stays fp32. The bf16 values
live in uint16 tensors: TVM 0.27's LLVM backend cannot compile bfloat16 vectors into the dot product (see
schedules.dpbf16ps), and uint16 keeps their bits exact.

The same rewrite, parameterized by a ``Packing``, serves fp32 on CPUs that the shipped logs do not suit
(``packed_fp32_contractions``): no conversion, the weights packed in panels of 3 vectors for
schedules.packed's micro-kernel, the weight gradients' X transposed as fp32.
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, tirx

from tvmdm.core.precision import check_precision
from tvmdm.transform.ir import bindings_of, call_op, function_pass, rewritten, static_shape
from tvmdm.transform.kernels import (BF16, LANES, PAIR, Packing, converted_shape, fp32_packing, gemm_func,
                                     pack_weight_func, packed_shape, to_bf16_func, transposed_rows_func)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """x [..., K] times a weight (or, ``batch`` > 0, a batched operand with x's first ``batch`` dims) of [K, N]
    ([N, K] when ``transposed``): rewritten as gemm(convert(x), pack(w))."""
    x: relax.Expr
    w: relax.Expr
    transposed: bool
    x_shape: list
    k: int
    n: int
    batch: int


@dataclasses.dataclass(frozen=True)
class WeightGradient:
    """X^T dY of X [rows, K] and dY [rows, N]: rewritten as gemm(transposed convert(X), pack(dY))."""
    x: relax.Expr
    dy: relax.Expr
    rows: int
    k: int
    n: int


def _weights(func: relax.Function) -> set:
    """The parameters of ``func`` after its inputs (its "num_input" attribute): the model's weights."""
    n_in = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else 0
    return set(func.params[n_in:])


def _weight_only(value, weights: set, bindings: dict, seen: dict) -> bool:
    """Whether ``value`` is computed from weights alone (a weight, or e.g. the merged QKV's concat of weights)."""
    if value not in seen:
        if value in weights:
            seen[value] = True
        elif isinstance(value, relax.Var) and value in bindings:
            bound = bindings[value]
            free = [bound] if isinstance(bound, relax.Var) else relax.analysis.free_vars(bound)
            seen[value] = all(_weight_only(v, weights, bindings, seen) for v in free)
        else:
            seen[value] = False
    return seen[value]


def _matrix_operand(value, bindings: dict, accept=lambda tensor: True):
    """(tensor, transposed) when ``value`` is a 2-D tensor ``accept`` takes, or permute_dims of one, else None."""
    bound = bindings.get(value)
    if call_op(bound) == "relax.permute_dims":
        src, axes = bound.args[0], bound.attrs.axes
        if len(src.ty.shape.values) == 2 and (axes is None or [int(a) for a in axes] == [1, 0]) and accept(src):
            return src, True
    return (value, False) if len(value.ty.shape.values) == 2 and accept(value) else None


def _weight_operand(value, weights: set, bindings: dict, seen: dict):
    """(weight, transposed) when ``value`` is a 2-D weight-only tensor or permute_dims of one, else None."""
    return _matrix_operand(value, bindings, lambda tensor: _weight_only(tensor, weights, bindings, seen))


def _batched(x, w):
    """The plan of a batched contraction of activations with equal batch dims (the attention's scores and
    context: [B, h, S, d] x [B, h, d, S]), its right operand packed per call; None for any other."""
    xs, ws = static_shape(x), static_shape(w)
    if xs is None or ws is None or len(xs) < 3 or len(xs) != len(ws) or xs[:-2] != ws[:-2] or xs[-1] != ws[-2] \
            or x.ty.dtype != "float32" or w.ty.dtype != "float32":
        return None
    k, n = ws[-2], ws[-1]
    return Gemm(x, w, False, xs, k, n, len(xs) - 2) if n % LANES == 0 and k % PAIR == 0 else None


def _plan(func: relax.Function, weights: set | None, packing: Packing = BF16) -> dict:
    """The contractions to rewrite: var -> Gemm or WeightGradient. ``weights`` None (training): every 2-D right operand and the weight
    gradients; else only right operands computed from ``weights`` alone. Batched
    contractions of activations (attention) in both, under bf16 only."""
    bindings, seen = bindings_of(func), {}
    targets = {}
    for var, value in bindings.items():
        if call_op(value) != "relax.matmul":
            continue
        x, w = value.args
        batched = _batched(x, w) if packing is BF16 else None
        if batched is not None:
            targets[var] = batched
            continue
        if weights is None:  # training: a weight gradient X^T dY (tvmdm.train.backward flattened its rows)
            wgrad = _weight_gradient(x, w, bindings, packing)
            if wgrad is not None:
                targets[var] = wgrad
                continue
        operand = _matrix_operand(w, bindings) if weights is None else _weight_operand(w, weights, bindings, seen)
        if operand is None or x.ty.dtype != "float32" or operand[0].ty.dtype != "float32":
            continue
        x_shape, w_shape = _rows_by_k(x), static_shape(operand[0])
        if x_shape is None or w_shape is None:
            continue
        n, k = (w_shape if operand[1] else w_shape[::-1])
        if not packing.fits(k, n):
            continue  # stays as it is: the packed layout needs whole panels (bf16: N % 16 == 0 and K even)
        targets[var] = Gemm(x, operand[0], operand[1], x_shape, k, n, 0)
    return targets


def _rows_by_k(x):
    """x's dims when its last (K) is concrete: the leading ones may be symbolic (a module serving every batch and
    seq; a converted operand then holds its rows padded, converted_shape)."""
    dims = list(x.ty.shape.values)
    return dims if isinstance(dims[-1], tirx.IntImm) else None


def _weight_gradient(x, w, bindings: dict, packing: Packing = BF16):
    """A WeightGradient when the contraction is matmul(permute_dims(X), dY) of 2-D X [rows, K] and
    dY [rows, N] in fp32: the left operand is converted transposed, in tiles."""
    left, right = _matrix_operand(x, bindings), _matrix_operand(w, bindings)
    if left is None or right is None or not left[1] or right[1]:
        return None
    shapes = static_shape(left[0]), static_shape(right[0])
    if None in shapes:
        return None
    (rows, k), (rows_dy, n) = shapes
    if rows != rows_dy or left[0].ty.dtype != "float32" or right[0].ty.dtype != "float32" or \
            not packing.fits(rows, n):
        return None
    return WeightGradient(left[0], right[0], rows, k, n)


def bf16_contractions(training: bool = False) -> tvm.transform.Pass:
    """Inference: matmul(x, W) with W a 2-D fp32 weight (or computed from weights only, like the merged QKV's
    packed matrix, or transposed) -> bf16_gemm(to_bf16(x), pack_bf16(W)) in ``main``; see the module doc.
    Training (every Relax function; the weights are fp32 master copies that change every step): every
    contraction with a 2-D right operand, packed each step, and each weight gradient X^T dY as one contraction
    over all rows. Activations read by several contractions (Q, K, V) are converted once."""

    return function_pass("tvmdm.BF16Contractions", lambda mod, name: _rewrite_function(mod, name, training),
                         every_function=training)


def packed_fp32_contractions(lanes: int, training: bool = False) -> tvm.transform.Pass:
    """CPUs without tuned schedules: matmul(x, W) with W a 2-D fp32 weight (or weight-only, or transposed) ->
    packed_gemm(x, pack(W)), W packed in panels of ``lanes`` columns ([N/lanes, K, lanes, 1]; made once at load
    by LiftTransformParams) for schedules.packed's register-tiled micro-kernel. ``training``: as
    bf16_contractions(training=True), in fp32: every contraction with a 2-D right operand packs it each step,
    and each weight gradient X^T dY reads a transposed copy of X."""
    packing = fp32_packing(lanes)
    return function_pass("tvmdm.PackedContractions",
                         lambda mod, name: _rewrite_function(mod, name, training, packing), every_function=training)


def _rewrite_function(mod: tvm.IRModule, name: str, training: bool, packing: Packing = BF16) -> tvm.IRModule:
    func = mod[name]
    targets = _plan(func, None if training else _weights(func), packing)
    if not targets:
        return mod

    @relax.expr_functor.mutator
    class ToBF16(relax.PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.converted = {}

        def _convert(self, x, make, shape, key):
            if not packing.converts and key == "to_bf16":  # fp32 activations are read as they are
                return self.visit_expr(x)
            if (x, key) not in self.converted:
                gv = self.builder_.add_func(make(static_shape(x) or list(x.ty.shape.values)), key)
                self.converted[(x, key)] = self.builder_.emit(relax.call_tir(
                    gv, [self.visit_expr(x)], relax.TensorType(shape, packing.dtype)))
            return self.converted[(x, key)]

        def _pack(self, w, k, n, transposed, batch=()):
            bb = self.builder_
            pack = bb.add_func(pack_weight_func(k, n, transposed, batch, packing), packing.pack_name)
            shape = list(batch) + packed_shape(k, n, packing)
            return bb.emit(relax.call_tir(pack, [w], relax.TensorType(shape, packing.dtype)))

        def _gemm(self, a_bits, packed, lead, k, n, batch=0):
            gemm = self.builder_.add_func(gemm_func(lead, k, n, batch, packing), packing.block)
            return self.builder_.emit(relax.call_tir(gemm, [a_bits, packed], relax.TensorType(list(lead) + [n],
                                                                                               "float32")))

        def visit_var_binding_(self, binding):
            target = targets.get(binding.var)
            if target is None:
                return super().visit_var_binding_(binding)
            t = target
            if isinstance(t, Gemm):
                packed = self._pack(self.visit_expr(t.w), t.k, t.n, t.transposed, t.x_shape[:t.batch])
                a_bits = self._convert(t.x, to_bf16_func, converted_shape(t.x_shape), "to_bf16")
                out = self._gemm(a_bits, packed, t.x_shape[:-1], t.k, t.n, t.batch)
            else:  # dW = X^T dY over every row
                packed = self._pack(self.visit_expr(t.dy), t.rows, t.n, False)
                a_bits = self._convert(t.x, lambda shape: transposed_rows_func(shape, packing), [t.k, t.rows],
                                       packing.transposed_name)
                out = self._gemm(a_bits, packed, [t.k], t.rows, t.n)
            self.set_var_remap(binding.var, out)
            return None

    return rewritten(mod, name, ToBF16(mod))


def half_contractions(dtype: str = "float16", training: bool = False) -> tvm.transform.Pass:
    """CUDA: every fp32 matmul -> matmul(a as fp16, b as fp16, out_dtype=fp32) (or bf16): the weight
    contractions and the attention's batched ones alike, so all of them run on tensor cores
    (schedules.tensor_cores for fp16; there is no bf16 tensor-core rule). A weight's cast is weight-only, so
    LiftTransformParams makes it once at load; an activation's cast fuses into its producer (the QKV
    projection's transposes, the softmax). ``training``: in every function (forward and backward; the fp32
    master weights are cast each step)."""

    return function_pass("tvmdm.HalfContractions", lambda mod, name: _half_function(mod, name, dtype),
                         every_function=training)


def _half_function(mod: tvm.IRModule, name: str, dtype: str) -> tvm.IRModule:
    func = mod[name]
    targets = {var for var, value in bindings_of(func).items() if call_op(value) == "relax.matmul"
               and value.args[0].ty.dtype == "float32" and value.args[1].ty.dtype == "float32"}
    if not targets:
        return mod

    @relax.expr_functor.mutator
    class ToHalf(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if binding.var not in targets:
                return super().visit_var_binding_(binding)
            bb = self.builder_
            x, w = (bb.emit(relax.op.astype(self.visit_expr(a), dtype)) for a in binding.value.args)
            self.set_var_remap(binding.var, bb.emit(relax.op.matmul(x, w, out_dtype="float32")))
            return None

    return rewritten(mod, name, ToHalf(mod))


def precision_passes(precision: str = "fp32", training: bool = False, target_kind: str = "llvm",
                     packed_lanes: int | None = None) -> list:
    """The graph passes for ``precision``, run before fusion (then LiftTransformParams packs the weights once,
    for inference). ``training``: the module is a training step (tvmdm.train). CPU bf16 has its own packed
    kernels; on CUDA both half types are casts around the contractions, left to dlight. ``packed_lanes``
    (fp32 inference on the CPU): pack the weights in panels that wide for schedules.packed."""
    check_precision(precision, target_kind)
    if precision == "fp32":
        return [packed_fp32_contractions(packed_lanes, training)] if packed_lanes else []
    if precision == "bf16" and target_kind == "llvm":
        return [bf16_contractions(training)]
    return [half_contractions({"bf16": "bfloat16", "fp16": "float16"}[precision], training)]
