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

Everything else (LayerNorm, softmax and its statistics, residual sums, the attention's batched contractions,
model inputs and outputs) stays fp32. The bf16 values live in uint16 tensors: TVM 0.27's LLVM backend cannot
compile bfloat16 buffers natively (see schedules/bf16.py), and uint16 keeps their bits exact.
"""
from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from tvmdm.errors import ShapeError
from tvmdm.graph_rewrites import call_op

PRECISIONS = ("fp32", "bf16", "fp16")
# Which target kinds each reduced precision is built for (its kernels and schedules are target-specific).
PRECISION_TARGETS = {"bf16": ("llvm",), "fp16": ("cuda",)}
# The documented accuracy of precision="bf16": max |out - out_fp32| / max |out_fp32| per output, vs onnxruntime
# fp32 (tests check it on tiny layers; bf16 keeps 8 bits of mantissa, a relative rounding of 2^-9 per operand).
BF16_MAX_REL_ERR = 1e-2
GEMM_BLOCK = "bf16_gemm"  # the contraction block schedules.bf16 looks for
LANES = 16  # fp32 accumulators per vdpbf16ps
PAIR = 2  # bf16 values per accumulator per vdpbf16ps
BITS = "uint16"


def check_precision(precision: str, target_kind: str | None = None) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    kinds = PRECISION_TARGETS.get(precision)
    if kinds and target_kind is not None and target_kind not in kinds:
        other = {"llvm": "bf16", "cuda": "fp16"}.get(target_kind)
        raise ValueError(f"precision={precision!r} is built for {'/'.join(kinds)} targets, not {target_kind}"
                         + (f"; use precision={other!r} there" if other else ""))
    return precision


def bf16_bits(value):
    """fp32 expression -> its bf16 bits (round to nearest, ties to even), as uint16."""
    bits = tirx.reinterpret("uint32", value)
    rounded = bits + tirx.const(0x7FFF, "uint32") + ((bits >> tirx.const(16, "uint32")) & tirx.const(1, "uint32"))
    return (rounded >> tirx.const(16, "uint32")).astype(BITS)


def bf16_value(bits):
    """bf16 bits (uint16) -> the fp32 value they encode (exact)."""
    return tirx.reinterpret("float32", bits.astype("uint32") << tirx.const(16, "uint32"))


def _i64(dims) -> tuple:
    """Shapes as int64, as LegalizeOps writes them (FuseTIR refuses to join buffers whose shapes differ in type)."""
    return tuple(tirx.IntImm("int64", int(d)) for d in dims)


def to_bf16_func(shape) -> tirx.PrimFunc:
    shape = _i64(shape)
    x = te.placeholder(shape, "float32", name="x")
    out = te.compute(shape, lambda *i: bf16_bits(x(*i)), name="to_bf16")
    return _private(te.create_prim_func([x, out]))


def _private(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """No global_symbol, like LegalizeOps' kernels: dead-code elimination may drop it once fused."""
    return func.without_attr("global_symbol") if func.attrs and "global_symbol" in func.attrs else func


def pack_bf16_func(k: int, n: int, transposed: bool) -> tirx.PrimFunc:
    """W [K, N] (or W^T [N, K] when ``transposed``) -> bf16 bits [N/16, K/2, 16, 2]."""
    w = te.placeholder(_i64((n, k) if transposed else (k, n)), "float32", name="w")

    def element(no, ko, ni, ki):
        row, col = ko * PAIR + ki, no * LANES + ni
        return bf16_bits(w[col, row] if transposed else w[row, col])

    out = te.compute(_i64((n // LANES, k // PAIR, LANES, PAIR)), element, name="pack_bf16")
    return _private(te.create_prim_func([w, out]))


def gemm_func(lead, k: int, n: int) -> tirx.PrimFunc:
    """C[lead..., N] (fp32) = A[lead..., K] (bf16 bits) x packed W (bf16 bits), block ``GEMM_BLOCK``."""
    a = te.placeholder(_i64(tuple(lead) + (k,)), BITS, name="a")
    w = te.placeholder(_i64((n // LANES, k // PAIR, LANES, PAIR)), BITS, name="w")
    r = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", k)), name="k")

    def element(*idx):
        *rows, col = idx
        return te.sum(bf16_value(a(*rows, r)) *
                      bf16_value(w[col // LANES, r // PAIR, col % LANES, r % PAIR]), axis=r)

    out = te.compute(_i64(tuple(lead) + (n,)), element, name=GEMM_BLOCK)
    # A contraction with element-wise epilogues: FuseOps may fuse bias / GELU / residual after it.
    return _private(te.create_prim_func([a, w, out])).with_attr("op_pattern", 4)


def _static(shape) -> list[int] | None:
    dims = []
    for d in shape.values:
        if not isinstance(d, tirx.IntImm):
            return None
        dims.append(int(d))
    return dims


def _weight_only(value, weights: set, bindings: dict, seen: dict) -> bool:
    """Whether ``value`` is computed from weights alone (a weight, or e.g. the merged QKV's concat of weights)."""
    if value in seen:
        return seen[value]
    if value in weights:
        result = True
    elif isinstance(value, relax.Var) and value in bindings:
        free = relax.analysis.free_vars(bindings[value]) if not isinstance(bindings[value], relax.Var) else [bindings[value]]
        result = all(_weight_only(v, weights, bindings, seen) for v in free)
    else:
        result = False
    seen[value] = result
    return result


def _weight_operand(value, weights: set, bindings: dict, seen: dict):
    """(weight, transposed) when ``value`` is a 2-D weight-only tensor or permute_dims of one, else None."""
    bound = bindings.get(value)
    if call_op(bound) == "relax.permute_dims":
        src, axes = bound.args[0], bound.attrs.axes
        if _weight_only(src, weights, bindings, seen) and len(src.ty.shape.values) == 2 and \
                (axes is None or [int(a) for a in axes] == [1, 0]):
            return src, True
    if _weight_only(value, weights, bindings, seen) and len(value.ty.shape.values) == 2:
        return value, False
    return None


def check_static_shapes(mod: tvm.IRModule) -> None:
    """ShapeError naming the first weight contraction whose activations have symbolic dims: the bf16 kernels are
    made for one shape (their tiles must divide it)."""
    func = mod["main"]
    n_in = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else 0
    weights = set(func.params[n_in:])
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    seen: dict = {}
    for var, value in bindings.items():
        if call_op(value) == "relax.matmul" and _weight_operand(value.args[1], weights, bindings, seen) and \
                _static(value.args[0].ty.shape) is None:
            x = value.args[0]
            raise ShapeError(f"precision='bf16' needs static shapes, but a weight contraction reads {x.name} of "
                             f"shape {list(x.ty.shape.values)}: bind the inputs' shapes with shapes= "
                             "(CLI: --shape NAME=D0xD1)")


def bf16_contractions() -> tvm.transform.Pass:
    """matmul(x, W) with W a 2-D fp32 weight (or computed from weights only, like the merged QKV's packed
    matrix, or transposed) -> bf16_gemm(to_bf16(x), pack_bf16(W)); see the module doc.
    Activations shared by several contractions (Q, K, V) are converted once. Needs static shapes."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.BF16Contractions")
    def rewrite(mod, _ctx):
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        func = mod["main"]
        n_in = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else 0
        weights = set(func.params[n_in:])
        bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        targets, seen = {}, {}
        for var, value in bindings.items():
            if call_op(value) != "relax.matmul":
                continue
            x, w = value.args
            operand = _weight_operand(w, weights, bindings, seen)
            if operand is None or x.ty.dtype != "float32" or operand[0].ty.dtype != "float32":
                continue
            x_shape = _static(x.ty.shape)
            w_shape = _static(operand[0].ty.shape)
            if x_shape is None:
                continue  # symbolic rows: check_static_shapes refuses such models before the passes run
            n, k = (w_shape if operand[1] else w_shape[::-1])
            if n % LANES or k % PAIR:
                continue  # stays fp32: the packed layout needs N % 16 == 0 and K even
            targets[var] = (operand, x_shape, k, n)
        if not targets:
            return mod

        @relax.expr_functor.mutator
        class ToBF16(relax.PyExprMutator):
            def __init__(self, mod):
                super().__init__(mod)
                self.converted = {}

            def _bits(self, x, shape):
                if x not in self.converted:
                    gv = self.builder_.add_func(to_bf16_func(shape), "to_bf16")
                    self.converted[x] = self.builder_.emit(relax.call_tir(
                        gv, [self.visit_expr(x)], relax.TensorType(shape, BITS)))
                return self.converted[x]

            def visit_var_binding_(self, binding):
                target = targets.get(binding.var)
                if target is None:
                    return super().visit_var_binding_(binding)
                (w, transposed), x_shape, k, n = target
                bb = self.builder_
                pack = bb.add_func(pack_bf16_func(k, n, transposed), "pack_bf16")
                packed = bb.emit(relax.call_tir(pack, [w], relax.TensorType(
                    (n // LANES, k // PAIR, LANES, PAIR), BITS)))
                gemm = bb.add_func(gemm_func(x_shape[:-1], k, n), GEMM_BLOCK)
                x_bits = self._bits(binding.value.args[0], x_shape)
                out = bb.emit(relax.call_tir(gemm, [x_bits, packed],
                                             relax.TensorType(x_shape[:-1] + [n], "float32")))
                self.set_var_remap(binding.var, out)
                return None

        mutator = ToBF16(mod)
        body = mutator.visit_expr(func).body
        out = mutator.builder_.get()  # the module with the new PrimFuncs
        out = tvm.IRModule(dict(out.functions.items()), attrs=mod.attrs)
        out["main"] = relax.Function(func.params, body, func.ret_ty, attrs=func.attrs)
        return out

    return rewrite


def half_contractions(dtype: str = "float16") -> tvm.transform.Pass:
    """CUDA: matmul(x, W) with W a weight -> matmul(x as fp16, W as fp16, out_dtype=fp32). dlight's Matmul rule
    schedules such a kernel on tensor cores (WMMA) when every dim exceeds 64 (sm_70 and later); the weight's
    cast is weight-only, so LiftTransformParams makes it once at load."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.HalfContractions")
    def rewrite(mod, _ctx):
        func = mod["main"]
        n_in = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else 0
        weights = set(func.params[n_in:])
        bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        seen: dict = {}
        targets = {var for var, value in bindings.items() if call_op(value) == "relax.matmul"
                   and value.args[0].ty.dtype == "float32" and value.args[1].ty.dtype == "float32"
                   and _weight_operand(value.args[1], weights, bindings, seen)}
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

        out = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
        out["main"] = ToHalf(mod).visit_expr(func)
        return out

    return rewrite


def precision_passes(precision: str = "fp32") -> list:
    """The graph passes for ``precision``, run before fusion (then LiftTransformParams packs the weights once)."""
    check_precision(precision)
    return {"fp32": [], "bf16": [bf16_contractions()], "fp16": [half_contractions("float16")]}[precision]
