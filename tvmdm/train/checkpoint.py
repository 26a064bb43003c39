"""Activation checkpointing as a Relax pass: mark attention blocks or whole encoder layers for recomputation.

Relax's Gradient recomputes, in the backward pass, what lies between ``relax.op.grad.start_checkpoint`` and
``end_checkpoint`` instead of keeping it alive from the forward pass. This pass finds the regions in an
imported BERT graph and wraps them:

  layer input  = a value three or more MatMuls read as their left operand (Q, K, V; or one MatMul of three
                 concatenated weights, the paper level's merged QKV), or the model input that plays that role;
  "attention"  = from a layer input to the next LayerNorm (self-attention, output dense, residual, LayerNorm);
  "layer"      = from a layer input to the second LayerNorm after it (the whole encoder layer).

Values from outside a region that it reads (the layer input, the additive mask) enter through
start_checkpoint; the region's LayerNorm output leaves through end_checkpoint. Numbers do not change.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmdm.transform.ir import call_op

MODES = ("attention", "layer")


def _used_vars(expr) -> list:
    found = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found


def find_regions(func: relax.Function, mode: str) -> list[tuple[int, int]]:
    """(first binding index, last binding index) of every region to recompute, in binding order."""
    if mode not in MODES:
        raise ValueError(f"unknown checkpoint mode {mode!r}; choose one of {list(MODES)} (or False)")
    if len(func.body.blocks) != 1:
        raise NotImplementedError("checkpointing expects main to be one dataflow block")
    bindings = list(func.body.blocks[0].bindings)
    defined_at = {b.var: i for i, b in enumerate(bindings)}
    values = {b.var: b.value for b in bindings}
    matmul_reads: dict = {}
    for i, b in enumerate(bindings):
        if call_op(b.value) == "relax.matmul":
            # a merged QKV contraction (fusion="paper") reads the layer input once for its concatenated weights
            weight = values.get(b.value.args[1])
            merged = len(weight.args[0].fields) if call_op(weight) == "relax.concat" and \
                isinstance(weight.args[0], relax.Tuple) else 1
            matmul_reads.setdefault(b.value.args[0], []).extend([i] * merged)
    norms = [i for i, b in enumerate(bindings) if call_op(b.value) == "relax.nn.layer_norm"]
    regions = []
    for var, readers in matmul_reads.items():
        if len(readers) < 3:
            continue
        start = defined_at.get(var, -1) + 1  # -1: a function parameter
        after = [n for n in norms if n >= start]
        need = 1 if mode == "attention" else 2
        if len(after) >= need:
            regions.append((start, after[need - 1]))
    return sorted(regions)


def insert_checkpoints(mode, n_inputs: int) -> tvm.transform.Pass:
    """Module pass: wrap the ``mode`` regions of ``main`` (whose first ``n_inputs`` parameters are the model's
    inputs, the rest weights) in start/end_checkpoint; a no-op when mode is falsy."""
    from tvm.relax.op.grad import end_checkpoint, start_checkpoint

    @relax.expr_functor.mutator
    class Insert(relax.PyExprMutator):
        def __init__(self, mod, bindings, regions):
            super().__init__(mod)
            self.index = {b.var: i for i, b in enumerate(bindings)}
            self.starts = {s: e for s, e in regions}
            self.ends = {e for _, e in regions}
            self.bindings = bindings
            self.restore = {}

        def visit_var_binding_(self, binding):
            i = self.index[binding.var]
            if i in self.starts:
                self._enter(i, self.starts[i])
            super().visit_var_binding_(binding)
            if i in self.ends:
                out = self.get_var_remap(binding.var)
                out = binding.var if out is None else out  # not remapped: the binding kept its var
                self.set_var_remap(binding.var, self.builder_.emit(end_checkpoint(out)))
                for var, original in self.restore.items():  # outside the region, the plain values again
                    self.set_var_remap(var, original)
                self.restore = {}

        def _enter(self, first: int, last: int) -> None:
            inside = {b.var for b in self.bindings[first:last + 1]}
            outside = []
            for b in self.bindings[first:last + 1]:
                for v in _used_vars(b.value):
                    if v not in inside and v not in outside and v in self.tensor_inputs:
                        outside.append(v)
            for v in outside:
                current = self.visit_expr(v)
                self.restore[v] = current
                self.set_var_remap(v, self.builder_.emit(start_checkpoint(current)))

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.InsertCheckpoints")
    def insert(mod, _ctx):
        if not mode:
            return mod
        func = mod["main"]
        regions = find_regions(func, mode)
        if not regions:
            raise ValueError(f"checkpoint={mode!r}: no encoder layer found in main (no value read by three "
                             "MatMuls followed by LayerNorm)")
        mutator = Insert(mod, list(func.body.blocks[0].bindings), regions)
        # activations only: weights are kept anyway, and wrapping them would not save a byte
        mutator.tensor_inputs = {b.var for b in func.body.blocks[0].bindings} | set(func.params[:n_inputs])
        gv = mod.get_global_var("main")
        mutator.builder_.update_func(gv, mutator.visit_expr(func))
        return mutator.builder_.get()

    return insert


def _tensor_bytes(ty) -> int:
    if isinstance(ty, relax.TupleType):
        return sum(_tensor_bytes(f) for f in ty.fields)
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return 0
    return int(np.prod([int(d) for d in ty.shape])) * tvm.DataType(ty.dtype).bits // 8


def memory_estimate(mod: tvm.IRModule, entry: str = "train_step") -> dict[str, int]:
    """Two views of the memory ``entry`` needs beyond its arguments, in bytes:

    planned: relax's own estimate after its static memory planning (``estimate_memory_usage``, "with memory
             planning"): the storage the compiled function really allocates;
    peak_live: the most bytes of intermediate tensors alive at once, walking the bindings in order (each from
             its definition to its last use): what an ideal allocator would need, and what checkpointing cuts.
    """
    func = mod[entry]
    bindings = [b for block in func.body.blocks for b in block.bindings]
    last_use = {}
    for i, b in enumerate(bindings):
        relax.analysis.post_order_visit(b.value, lambda e, i=i: last_use.__setitem__(e, i)
                                        if isinstance(e, relax.Var) else None)
    relax.analysis.post_order_visit(func.body.body, lambda e: last_use.__setitem__(e, len(bindings))
                                    if isinstance(e, relax.Var) else None)
    alive, live, peak = {}, 0, 0
    for i, b in enumerate(bindings):
        # aliases, tuples of existing tensors and their items allocate nothing
        size = 0 if isinstance(b.value, (relax.Var, relax.TupleGetItem, relax.Tuple)) else _tensor_bytes(b.var.ty)
        alive[b.var] = size
        live += size
        peak = max(peak, live)
        for v in [v for v in alive if last_use.get(v, -1) <= i]:
            live -= alive.pop(v)
    seq = tvm.transform.Sequential([relax.transform.ToNonDataflow(), relax.transform.RemovePurityChecking(),
                                    relax.transform.CallTIRRewrite(), relax.transform.StaticPlanBlockMemory()])
    planned = seq(tvm.IRModule({gv: f for gv, f in mod.functions.items()
                                if gv.name_hint == entry or isinstance(f, tvm.tirx.PrimFunc)}))
    alloc_storage = tvm.ir.Op.get("relax.memory.alloc_storage")
    storage = []
    relax.analysis.post_order_visit(planned[entry].body, lambda e: storage.append(int(e.args[0].values[0]))
                                    if isinstance(e, relax.Call) and e.op.same_as(alloc_storage) else None)
    return {"planned": sum(storage), "peak_live": peak}
