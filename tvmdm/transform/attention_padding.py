"""Symbolic sequences padded to whole vectors of keys around the paper's attention kernels (CPU inference).

A module compiled with a symbolic sequence length ("one module, many shapes") gave SM and the context
contraction key and query axes of unknown length: their schedules (schedules.attention) could not split them
into whole vectors and register tiles, and took a ragged path, one query row at a time with scalar softmax
reductions (base layer at (1, 512) on 2 AVX2 cores: SM 10.0 ms and context 9.5 against 4.9 and 3.5 bound; with this
pass 5.2 and 4.0, the whole layer 51.7 ms against 51.1 bound and 61.8 before).

``pad_attention_keys()`` pads each SM / context pair to ``KEY_MULTIPLE`` positions: the tensors they read get
rows up to ceil(S / KEY_MULTIPLE) * KEY_MULTIPLE along every axis of length S (zeros; the additive mask: -inf,
so a padded key's probability is 0 even in a row whose real keys are all masked), and the context's output is
cut back to S rows. The padded query rows compute finite values nobody reads.

Lowered, a kernel is a PrimFunc of its own symbolic length again, which says nothing of the multiple:
``whole_block_kernels()`` (after FuseTIR) specializes each kernel that reads padded tensors to take the number
of blocks as a scalar parameter and every padded axis as blocks * KEY_MULTIPLE, so the schedules prove the
multiple (schedules.default.divides) and split those axes without predicates. (0.27 offers no other way to
carry it: a Relax function's R.Prim parameter cannot define a symbolic var, and FuseTIR refused a composite's
R.Shape parameter; telling the schedules by an attribute and splitting without predicates left compute_at
with over-approximated regions, SM 68-170 ms.)

Preconditions: after the paper's pattern fusion (composite functions "tvmdm.sm" and
"tvmdm.attention_context", see tvmdm.transform.patterns) and before LegalizeOps; SM's output read only by a
context kernel (inference: a training step's backward pass also reads it, and is left alone). Pairs whose key
axis is concrete are left alone.
"""
from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from tvmdm.transform.ir import bindings_of, call_op, function_pass, readers_of, rewritten
from tvmdm.transform.kernels import private_func

# SM's register tile (schedules.attention: KEY_VECTORS = 2 vectors of keys): two vectors of AVX-512, four of
# AVX2. At 16 (one AVX-512 vector) SM could not prove 2 vectors and took 1: 2.63 against 2.30 ms a layer at
# (1, 512) on 2 Sapphire Rapids cores (int8 base layer, in place)
KEY_MULTIPLE = 32
SM, CONTEXT = "tvmdm.sm", "tvmdm.attention_context"
PAD_KERNEL = "pad_keys"


def padded_length(length):
    return tirx.floordiv(length + (KEY_MULTIPLE - 1), KEY_MULTIPLE) * KEY_MULTIPLE


def pad_func(shape, length: tirx.Var, value: float, dtype: str) -> tirx.PrimFunc:
    """y = x with every axis of extent ``length`` padded to padded_length(length) with ``value``."""
    axes = [a for a, d in enumerate(shape) if d.same_as(length)]
    x = te.placeholder(shape, dtype, name="x")
    out_shape = [padded_length(d) if a in axes else d for a, d in enumerate(shape)]

    def element(*idx):
        inside = tirx.all(*[idx[a] < length for a in axes])
        clamped = [tirx.min(i, length - 1) if a in axes else i for a, i in enumerate(idx)]
        return tirx.Select(inside, x(*clamped), tirx.const(value, dtype))

    y = te.compute(out_shape, element, name="pad_keys")
    return private_func(te.create_prim_func([x, y])).with_attr("op_pattern", 8)  # a kernel of its own


def cut_func(padded_shape, shape, dtype: str) -> tirx.PrimFunc:
    """y = the first ``shape`` of x: its padded rows dropped (a copy of the real rows, ~0.1 ms at (8, 128):
    its reader, the output projection, is a kernel of ours that FuseOps does not fuse into)."""
    x = te.placeholder(padded_shape, dtype, name="x")
    y = te.compute(shape, lambda *idx: x(*idx), name="cut_keys")
    return private_func(te.create_prim_func([x, y])).with_attr("op_pattern", 2)


def pad_attention_keys() -> tvm.transform.Pass:
    """See the module doc."""
    return function_pass("tvmdm.PadAttentionKeys", _rewrite_function, every_function=False)


def composite_name(mod: tvm.IRModule, value) -> str | None:
    if not isinstance(value, relax.Call) or not isinstance(value.op, relax.GlobalVar):
        return None
    func = mod[value.op]
    return str(func.attrs["Composite"]) if isinstance(func, relax.Function) and func.attrs is not None \
        and "Composite" in func.attrs else None


def _mask_params(func: relax.Function) -> set:
    """The composite SM's parameters added to the scores (the additive mask): padded with -inf."""
    params = set(func.params)
    return {arg for value in bindings_of(func).values() if call_op(value) == "relax.add"
            for arg in value.args if arg in params}


def _plan(mod: tvm.IRModule, func: relax.Function) -> dict:
    """sm var -> its key length (a tirx.Var), for SM calls with a symbolic key axis read only by contexts."""
    bindings = bindings_of(func)
    readers = readers_of(func)
    plan = {}
    for var, value in bindings.items():
        if composite_name(mod, value) != SM:
            continue
        length = var.ty.shape.values[-1]
        users = readers.get(var, [])
        if isinstance(length, tirx.Var) and users and all(composite_name(mod, bindings[u]) == CONTEXT for u in users):
            plan[var] = length
    return plan


def _rewrite_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    plan = _plan(mod, mod[name])
    if not plan:
        return mod
    bindings = bindings_of(mod[name])
    contexts = {var: sm for sm in plan for var, value in bindings.items()
                if composite_name(mod, value) == CONTEXT and any(arg.same_as(sm) for arg in value.args)}

    @relax.expr_functor.mutator
    class PadKeys(relax.PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.padded = {}  # (var, pad value) -> its padded copy (Q, K and V's tensor serves both kernels)

        def _pad(self, arg, length, value: float):
            shape = getattr(arg.ty, "shape", None)
            if shape is None or not any(d.same_as(length) for d in shape.values):
                return arg
            if (arg, value) not in self.padded:
                pad = self.builder_.add_func(pad_func(list(shape.values), length, value, arg.ty.dtype), PAD_KERNEL)
                out_shape = [padded_length(d) if d.same_as(length) else d for d in shape.values]
                self.padded[(arg, value)] = self.builder_.emit(
                    relax.call_tir(pad, [arg], relax.TensorType(out_shape, arg.ty.dtype)))
            return self.padded[(arg, value)]

        def visit_var_binding_(self, binding):
            value = binding.value
            sm = binding.var if binding.var in plan else contexts.get(binding.var)
            if sm is None:
                return super().visit_var_binding_(binding)
            length, composite = plan[sm], mod[value.op]
            masks = _mask_params(composite) if binding.var in plan else set()
            args = []
            for arg, param in zip(value.args, composite.params):
                new = self.visit_expr(arg)
                if not arg.same_as(sm):  # (SM's output is padded already)
                    new = self._pad(new, length, float("-inf") if param in masks else 0.0)
                args.append(new)
            out = self.builder_.emit(relax.Call(value.op, args))
            if binding.var in contexts:  # back to the real rows
                shape = list(binding.var.ty.shape.values)
                cut = self.builder_.add_func(cut_func(list(out.ty.shape.values), shape, out.ty.dtype), "cut_keys")
                out = self.builder_.emit(relax.call_tir(cut, [out], relax.TensorType(shape, out.ty.dtype)))
            self.set_var_remap(binding.var, out)
            return None

    return rewritten(mod, name, PadKeys(mod))


def whole_block_kernels() -> tvm.transform.Pass:
    """After FuseTIR, on main: a kernel every call of which reads pad_keys outputs takes (inputs..., blocks,
    outputs...) with its padded axes blocks * KEY_MULTIPLE (see the module doc), under its own name."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.WholeBlockKernels")
    def run(mod, _ctx):
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()] or \
                not any(gv.name_hint.startswith(PAD_KERNEL) for gv in mod.get_global_vars()):
            return mod
        bindings = bindings_of(mod["main"])
        calls: dict = {}  # kernel -> {binding var: (the kernel's var, main's padded length), or None}
        for var, value in bindings.items():
            if call_op(value) == "relax.call_tir":
                found = _padded_lengths(mod[value.args[0]], value.args[1].fields, bindings)
                calls.setdefault(value.args[0], {})[var] = found[0] if len(found) == 1 else None
        kernels = {gv: next(iter(sites.values()))[0] for gv, sites in calls.items()
                   if all(sites.values()) and len({own.name for own, _ in sites.values()}) == 1}
        if not kernels:
            return mod
        padded = {var: length for gv in kernels for var, (_, length) in calls[gv].items()}
        specialized = {gv: _in_blocks(mod[gv], own, len(mod[gv].params) - _outputs(bindings[next(iter(calls[gv]))]))
                       for gv, own in kernels.items()}
        # each under a new GlobalVar of its name (a GlobalVar carries its function's signature)
        rest = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in kernels}, attrs=mod.attrs)
        return rewritten(rest, "main", _PassBlocks(rest, padded, specialized))

    return run


def _padded_lengths(kernel: tirx.PrimFunc, args, bindings: dict) -> list:
    """[(the kernel's shape var, main's padded length)] at the axes its pad_keys arguments padded."""
    found = {}
    for param, arg in zip(kernel.params, args):
        producer = bindings.get(arg) if isinstance(arg, relax.Var) else None
        if call_op(producer) != "relax.call_tir" or not producer.args[0].name_hint.startswith(PAD_KERNEL):
            continue
        for dim, padded in zip(param.shape, arg.ty.shape.values):  # (0.27: a param is its buffer)
            if isinstance(dim, tirx.Var) and not isinstance(padded, (tirx.Var, tirx.IntImm)):
                found[dim] = padded
    return list(found.items())


def _outputs(call) -> int:
    return len(call.ty.fields) if isinstance(call.ty, relax.TupleType) else 1


def _in_blocks(kernel: tirx.PrimFunc, length: tirx.Var, inputs: int) -> tirx.PrimFunc:
    """``kernel`` with a scalar parameter ``blocks`` after its inputs (where call_tir passes scalars) and
    ``length`` = blocks * KEY_MULTIPLE."""
    blocks = tirx.Var("blocks", "int64")
    params = list(kernel.params[:inputs]) + [blocks] + list(kernel.params[inputs:])
    func = tirx.PrimFunc(params, kernel.body, kernel.ret_type, kernel.attrs)
    param = next(p for p in kernel.params if any(d.same_as(length) for d in p.shape))
    shape = [blocks * KEY_MULTIPLE if d.same_as(length) else d for d in param.shape]
    return func.specialize({param: tirx.decl_buffer(shape, param.dtype, name=param.name)})


@relax.expr_functor.mutator
class _PassBlocks(relax.PyExprMutator):
    """main's calls of the specialized kernels given their number of blocks (``padded``: binding var -> the
    padded length of its call)."""

    def __init__(self, mod, padded: dict, specialized: dict):
        super().__init__(mod)
        self.padded = padded
        self.renamed = {gv: self.builder_.add_func(func, gv.name_hint) for gv, func in specialized.items()}

    def visit_var_binding_(self, binding):
        if binding.var not in self.padded:
            return super().visit_var_binding_(binding)
        value = binding.value
        blocks = tvm.sym.Analyzer().simplify(tirx.floordiv(self.padded[binding.var], KEY_MULTIPLE))
        args = [self.visit_expr(arg) for arg in value.args[1].fields] + [blocks]
        call = relax.call_tir(self.renamed[value.args[0]], args, value.ty)
        self.set_var_remap(binding.var, self.builder_.emit(call))
        return None
