"""Whole-tensor max / min as a row reduction, then a reduction of the rows' results.

DynamicQuantizeLinear (onnxruntime's dynamic quantization, before every int8 contraction) takes the max and the
min of its whole input to choose the scale. LegalizeOps writes ``max(x, axis=None)`` as one serial reduction
over every element: the schedules cannot split it over the cores (1.7 ms for [8, 128, 3072] on 2 Zen 4 cores).
Written as ``max(max(x, axis=-1), axis=None)`` the rows reduce in parallel (vectorized), and the second
reduction reads one value per row. max and min are exact in any order: the results are the same.

Where both the max and the min of one tensor are taken (DynamicQuantizeLinear always takes both), one kernel
(``row_extrema_func``) reduces each row to both while it is in L1, instead of two kernels each reading the whole
tensor from memory.

Precondition: none (a tensor of rank < 2, or already reduced by axis, is left as it is).
"""
from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from tvmdm.transform.ir import call_op, function_pass, rewritten
from tvmdm.transform.kernels import int64_dims, lead_dims, private_func

WHOLE_TENSOR_REDUCTIONS = {"relax.max": relax.op.max, "relax.min": relax.op.min}
EXTREMA = "row_extrema"  # row_extrema_func's output block, after its two row reductions (schedules.rows)


def _whole_tensor(value) -> bool:
    if call_op(value) not in WHOLE_TENSOR_REDUCTIONS or value.attrs.axis is not None or value.attrs.keepdims:
        return False
    shape = getattr(value.args[0].ty, "shape", None)
    return shape is not None and len(shape.values) >= 2


def row_extrema_func(shape, dtype: str) -> tirx.PrimFunc:
    """x [rows..., K] -> [rows..., 2]: each row's max (0) and its min negated (1) over K, both reductions of a
    row in one kernel (a row reduction each, then the block that writes them: schedules.rows). Negated, the
    whole tensor's max and min come out of one max over the rows."""
    *lead, k = shape
    lead = lead_dims(lead)
    x = te.placeholder(lead + int64_dims((k,)), dtype, name="x")
    r_max = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", int(k))), name="k")
    r_min = te.reduce_axis((tirx.IntImm("int64", 0), tirx.IntImm("int64", int(k))), name="k")
    row_max = te.compute(lead, lambda *i: te.max(x(*i, r_max), axis=r_max), name="row_max")
    row_min = te.compute(lead, lambda *i: te.min(x(*i, r_min), axis=r_min), name="row_min")
    out = te.compute(lead + int64_dims((2,)), lambda *i: tirx.Select(i[-1] == 0, row_max(*i[:-1]),
                                                                       -row_min(*i[:-1])), name=EXTREMA)
    return private_func(te.create_prim_func([x, out])).with_attr("op_pattern", 8)  # a kernel of its own


def rows_then_whole() -> tvm.transform.Pass:
    """max(x) / min(x) over every element of x (rank >= 2) -> the same over the rows' max / min, both from one
    kernel where both are taken; see the module doc."""
    return function_pass("tvmdm.RowsThenWhole", _rewrite_function)


def _rewrite_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    func = mod[name]
    reduced = {}  # source -> the ops that reduce all of it
    for block in func.body.blocks:
        for binding in block.bindings:
            if _whole_tensor(binding.value):
                reduced.setdefault(binding.value.args[0], set()).add(call_op(binding.value))
    if not reduced:
        return mod
    paired = {source for source, ops in reduced.items() if len(ops) == 2 and
              all(isinstance(d, (int, tirx.IntImm)) for d in source.ty.shape.values[-1:])}

    @relax.expr_functor.mutator
    class RowsThenWhole(relax.PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.extrema = {}  # paired source -> [its max, -its min]

        def _whole(self, source, op: str) -> relax.Expr:
            x, reduce = self.visit_expr(source), WHOLE_TENSOR_REDUCTIONS[op]
            if source not in paired:
                return reduce(self.builder_.emit(reduce(x, axis=[-1])))
            if source not in self.extrema:  # [max, -min] of every row, then of all of them
                shape = list(x.ty.shape.values)
                kernel = self.builder_.add_func(row_extrema_func(shape, x.ty.dtype), "row_extrema")
                rows = self.builder_.emit(relax.call_tir(kernel, [x], relax.TensorType(shape[:-1] + [2],
                                                                                        x.ty.dtype)))
                self.extrema[source] = self.builder_.emit(relax.op.max(rows, axis=list(range(len(shape) - 1))))
            index = int(op == "relax.min")
            slot = relax.op.squeeze(relax.op.strided_slice(self.extrema[source], axes=[0], begin=[index],
                                                           end=[index + 1]), axis=[0])
            return slot if op == "relax.max" else relax.op.negative(self.builder_.emit(slot))

        def visit_var_binding_(self, binding):
            if not _whole_tensor(binding.value):
                return super().visit_var_binding_(binding)
            whole = self._whole(binding.value.args[0], call_op(binding.value))
            self.set_var_remap(binding.var, self.builder_.emit(whole))
            return None

    return rewritten(mod, name, RowsThenWhole(mod))
