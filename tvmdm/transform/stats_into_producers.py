"""DynamicQuantizeLinear's statistics computed by the kernel that produces the activation.

Before every int8 contraction of a dynamically quantized model, DynamicQuantizeLinear takes the max and the min
of its whole input x (rows_then_whole: one ``row_extrema`` kernel reading x, then a max over its rows), and
then quantizes x (a second read). x was written just before by one kernel: the LayerNorm (BDRLN) before QKV and
FFN1, the FFN1 contraction with its bias and GELU before FFN2. Here that kernel also writes partial extrema of
what it produces, while its output is still in the core's cache, and the row_extrema kernel's pass over x from
memory is gone (BERT-base's FFN1 output at (8, 128): 12.6 MB).

The partials are laid out for the producer's unit of work, so that it takes only element-wise vector maxima:
  a row-wise kernel (LayerNorm: a row at a time) - each row's maxima a vector wide, [rows..., 2, LANES] (the
      row's two slots next to each other: with the slot axis first, a symbolic-size output put them a symbolic
      stride apart, which LLVM could not tell apart, and it kept both in memory);
  an int8 contraction (a tile of rows by a few columns at a time) - each column's over groups of GROUP_ROWS
      rows (which divide its rows, static: _fits), [2, lead..., groups, N];
slot 0 the max, slot 1 the max of -x. Then one small kernel (``extrema_of_partials``; for a contraction's,
``row_max`` first over their last axis) reduces them to the [2] the quantization reads: the same numbers as
before, max and min being exact in any order. The schedules (schedules.rows.place_partials) compute the partials under the producer's
unit loop, or, where they cannot, as a parallel pass of their own in the same kernel.

Preconditions: after FuseTIR (the producer a fused PrimFunc with one output; row_extrema kernels made by
rows_then_whole, each read by one whole max); CPU targets. Producers of other kinds keep row_extrema.
"""
from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from tvmdm.transform.int8_kernels import INT8_GEMM_BLOCK
from tvmdm.transform.ir import bindings_of, has_block, merging_pass, primitive_call, readers_of, rewritten
from tvmdm.transform.kernels import LANES, int64_dims, lead_dims, private_func
from tvmdm.transform.row_reductions import EXTREMA

PARTIALS = "extrema_partials"  # the producer's block of partial extrema (schedules.rows.place_partials)
GROUP_ROWS = 32  # rows per partial of a contraction's output (schedules.amx's blocks of rows are 32 or 128)
ROW_STATS_KERNELS = ("layer_norm", "bdrln")  # row-wise producers (op names of their kernels)


def _signed(c, value):
    """The value for slot ``c``: itself for the max (0), negated for the min (1)."""
    return tirx.Select(c == 0, value, -value)


def partials_shape(shape, group_rows: int | None) -> list:
    """The partials' shape for a producer's output of ``shape`` [lead..., rows, N]: [lead..., rows, 2, LANES]
    for a row-wise producer (``group_rows`` None), [2, lead..., ceil(rows / group_rows), N] for a contraction."""
    *lead, rows, n = shape
    if group_rows is None:
        return [*lead, rows, 2, LANES]
    return [2, *lead, (rows + group_rows - 1) // group_rows, n]


def slot_axis(group_rows: int | None, rank: int) -> int:
    """The axis of the partials (of ``rank`` axes) that holds the max (0) and the negated min (1)."""
    return rank - 2 if group_rows is None else 0


def extrema_partials_func(shape, group_rows: int | None) -> tirx.PrimFunc:
    """y [lead..., rows, N] (fp32) -> its partial extrema (partials_shape): slot 0 the max, slot 1 the max of
    -y; of each row's every LANES-th value (``group_rows`` None: a vector's worth of maxima a row, no horizontal
    steps), or of each column over every ``group_rows`` rows (rows past the end of a last, shorter group left
    out). Either way the reduction is the last axis, the vector the one before."""
    *lead, n = shape
    lead = lead_dims(lead)
    *outer, rows = lead
    y = te.placeholder(lead + int64_dims((n,)), "float32", name="y")
    zero = tirx.IntImm("int64", 0)
    if group_rows is None:
        lanes = tirx.IntImm("int64", LANES)
        k = te.reduce_axis((zero, tirx.IntImm("int64", int(n) // LANES)), name="k")
        out = te.compute(lead + int64_dims((2, LANES)),
                         lambda *i: te.max(_signed(i[-2], y(*i[:-2], k * lanes + i[-1])), axis=k), name=PARTIALS)
    else:
        size = tirx.IntImm("int64", group_rows)
        r = te.reduce_axis((zero, size), name="r")
        whole = isinstance(rows, tirx.IntImm) and int(rows) % group_rows == 0

        def partial(c, *index):
            *o, g, j = index
            row = g * size + r
            value = _signed(c, y(*o, row, j))
            if not whole:  # rows past the end are not read: the max's identity instead
                value = tirx.if_then_else(row < rows, value, tirx.min_value("float32"))
            return te.max(value, axis=r)

        groups = (rows + size - 1) // size
        out = te.compute(int64_dims((2,)) + tuple(outer) + (groups,) + int64_dims((n,)), partial, name=PARTIALS)
    return private_func(te.create_prim_func([y, out]))


def _max_keeping(shape, kept: list[int], name: str) -> tirx.PrimFunc:
    """x of ``shape`` -> its max over every axis not in ``kept`` (the output's axes, in order)."""
    dims = lead_dims(shape)
    x = te.placeholder(dims, "float32", name="x")
    reduce = {a: te.reduce_axis((tirx.IntImm("int64", 0), dims[a]), name=f"k{a}")
              for a in range(len(dims)) if a not in kept}

    def element(*index):
        at = dict(zip(kept, index))
        return te.max(x(*[at[a] if a in at else reduce[a] for a in range(len(dims))]), axis=list(reduce.values()))

    out = te.compute([dims[a] for a in kept], element, name=name)
    return private_func(te.create_prim_func([x, out]))


def _producer_kind(func: tirx.PrimFunc, name: str) -> int | None | bool:
    """GROUP_ROWS for a contraction, None for a row-wise kernel, False for a kernel this pass leaves alone."""
    if has_block(func, INT8_GEMM_BLOCK):
        return GROUP_ROWS
    if any(name.startswith(k) for k in ROW_STATS_KERNELS):
        return None
    return False


def _fits(shape, kind) -> bool:
    """Whether the producer's units can compute the partials of an output of ``shape``: its width whole
    vectors; a contraction's rows static and whole groups (its tile units then cover whole groups: symbolic
    rows come in padded tiles copied out under a guard, past which the partials cannot be placed, and a pass
    of their own after the tiles was 2-4 % slower than the row_extrema kernel at BERT-base's (1, 128) and
    (1, 512) on 2 Sapphire Rapids cores: one more small kernel each)."""
    width, rows = shape[-1], shape[-2]
    if not isinstance(width, tirx.IntImm) or int(width) % LANES:
        return False
    return kind is None or isinstance(rows, tirx.IntImm) and int(rows) % GROUP_ROWS == 0


def _is_row_extrema(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and has_block(func, EXTREMA)


def stats_into_producers(provenance: dict | None = None) -> tvm.transform.Pass:
    """Each row_extrema kernel whose input a contraction or a row-wise kernel produces -> that kernel with the
    partial extrema as a second output, and the reductions of the partials (see the module doc).
    ``provenance`` (fusion's kernel -> ops record), if given, learns the merged kernels' ops."""
    return merging_pass("tvmdm.StatsIntoProducers", _rewrite, provenance)


def _pairs(mod: tvm.IRModule, func: relax.Function) -> dict:
    """row_extrema binding var -> (its input's var, the var of the whole max reading it, the producer's kind
    (_producer_kind)) for those this pass takes."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    bindings, readers = bindings_of(func), readers_of(func)
    found = {}
    for var, value in bindings.items():
        if not (isinstance(value, relax.Call) and value.op.same_as(call_tir) and _is_row_extrema(mod[value.args[0]])):
            continue
        source = value.args[1].fields[0]
        produced = bindings.get(source)
        users = readers.get(var, [])
        if not (isinstance(produced, relax.Call) and produced.op.same_as(call_tir)) or len(users) != 1:
            continue
        producer = mod[produced.args[0]]
        if len(producer.params) - len(produced.args[1].fields) - (len(produced.args) > 2) != 1:
            continue  # one output
        kind = _producer_kind(producer, produced.args[0].name_hint)
        if kind is not False and str(source.ty.dtype) == "float32" and _fits(source.ty.shape.values, kind):
            found[var] = (source, users[0], kind)
    return found


def _rewrite(mod: tvm.IRModule, name: str, provenance: dict) -> tuple[tvm.IRModule, bool]:
    func = mod[name]
    pairs = _pairs(mod, func)
    if not pairs:
        return mod, False

    @relax.expr_functor.mutator
    class Merge(relax.PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.partials = {}  # producer output var -> (its partials' var, their shape)

        def visit_var_binding_(self, binding):
            var = binding.var
            extrema = next((p for p in pairs.values() if p[0].same_as(var)), None)
            if extrema is not None:
                self._merge(binding, extrema[2])
                return None
            if var in pairs:
                return None  # row_extrema: its reader now reduces the partials
            whole = next((k for k, p in pairs.items() if p[1].same_as(var)), None)
            if whole is not None:
                source, _, kind = pairs[whole]
                self.set_var_remap(var, self._reduced(self.partials[source], kind))
                return None
            return super().visit_var_binding_(binding)

        def _merge(self, binding, kind):
            """The producer's call -> a call of a Primitive function of it and the partials (FuseTIR makes
            them one kernel)."""
            call = binding.value
            shape = list(binding.var.ty.shape.values)
            p_ty = relax.TensorType(partials_shape(shape, kind), "float32")
            partial_kernel = self.builder_.add_func(extrema_partials_func(shape, kind), PARTIALS)
            args = [self.visit_expr(a) for a in call.args[1].fields]

            def body(fb, inner):
                y = fb.emit(relax.call_tir(call.args[0], [inner(a) for a in args], binding.var.ty))
                return relax.Tuple([y, fb.emit(relax.call_tir(partial_kernel, [y], p_ty))])

            merged = primitive_call(self.builder_, f"{call.args[0].name_hint}_stats", args, body)
            provenance[merged.op.name_hint] = provenance.get(call.args[0].name_hint, []) + ["row_extrema"]
            both = self.builder_.emit(merged)
            self.set_var_remap(binding.var, self.builder_.emit(relax.TupleGetItem(both, 0)))
            self.partials[binding.var] = (self.builder_.emit(relax.TupleGetItem(both, 1)),
                                          partials_shape(shape, kind))

        def _reduced(self, partials, kind):
            partials, shape = partials
            if kind is not None:  # a contraction's (N per group): the last axis first, a row reduction
                rows = self.builder_.add_func(_max_keeping(shape, list(range(len(shape) - 1)), "row_max"),
                                              "row_max")
                partials = self.builder_.emit(relax.call_tir(rows, [partials],
                                                             relax.TensorType(shape[:-1], "float32")))
                shape = shape[:-1]
            whole = self.builder_.add_func(_max_keeping(shape, [slot_axis(kind, len(shape))], "extrema"),
                                           "extrema_of_partials")
            return self.builder_.emit(relax.call_tir(whole, [partials], relax.TensorType([2], "float32")))

    return rewritten(mod, name, Merge(mod)), True
