"""Every workaround for a TVM 0.27 internal lives here, each with a regression test in tests/test_compat.py.

When TVM or tvm-ffi is upgraded, run that test file first: a workaround that is no longer needed, or that no
longer applies, shows up there at once. Nothing else in tvmdm reaches into TVM's private modules.
Pinned: apache-tvm==0.27.0.post1, apache-tvm-ffi==0.1.14.post1 (0.1.15.post2 segfaults in save_json).
"""
from __future__ import annotations

import os

import numpy as np

_PATCHED = False
NUM_THREADS_ENV = "TVM_NUM_THREADS"


def use_all_cores() -> None:
    """TVM's CPU thread pool defaults to half the hardware threads on x86 (it assumes two hyper-threads per core):
    on a 2-core VM without SMT every kernel ran on ONE thread while onnxruntime and torch used two. The pool reads
    TVM_NUM_THREADS when it is first made (lazily, at the first parallel kernel), so default it to the cores this
    process may run on at tvmdm's import. A value the user set is kept."""
    if NUM_THREADS_ENV not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ[NUM_THREADS_ENV] = str(cores)
# The frontend's own converters, kept so the regression tests can show each bug is still there.
ORIGINAL_CONVERTERS: dict = {}


def _frontend():
    from tvm.relax.frontend.onnx import onnx_frontend

    return onnx_frontend


def _constant_of_shape_converter(base):
    """TVM's ConstantOfShape broadcasts the (1,)-shaped ``value`` tensor to the target shape, which fails
    for a 0-d target (``[]``), as in every BERT export by torch's legacy exporter: scalarize it first."""
    class ConstantOfShape(base):
        @classmethod
        def _impl_v9(cls, bb, inputs, attr, params):
            value = attr.get("value")
            if value is not None:
                array = _frontend().get_numpy(value)
                if array.size == 1 and array.ndim > 0:
                    attr = dict(attr, value=_scalar_tensor_proto(array))
            return super()._impl_v9(bb, inputs, attr, params)

    return ConstantOfShape


def _scalar_tensor_proto(array: np.ndarray):
    from onnx import numpy_helper

    return numpy_helper.from_array(array.reshape(()))


def _range_converter(base):
    """TVM's Range turns a limit that is a PrimExpr (the ``seq`` dim from ``Shape``, symbolic or bound)
    into a data-dependent ``range_len`` var, so position ids stop matching (batch, seq) and later shapes are
    lost. Emit ``relax.op.arange`` with that extent instead when start and delta are constants."""
    import tvm
    from tvm import relax

    def as_prim(x, params):
        x = _frontend().get_constant(x, params)
        if isinstance(x, tvm.ir.GenericConst):
            value = x.value.numpy()
            return int(value.reshape(-1)[0]) if value.size == 1 and value.dtype.kind in "iu" else None
        if tvm.ir.is_prim_expr(x):
            return x
        if isinstance(x, relax.Expr) and isinstance(x.ty, relax.ShapeType) and x.ty.values is not None:
            return x.ty.values[0] if len(x.ty.values) == 1 else None
        return None

    class Range(base):
        @classmethod
        def _impl_v12(cls, bb, inputs, attr, params):
            start, limit, delta = (as_prim(x, params) for x in inputs)
            if tvm.ir.is_prim_expr(limit) and isinstance(start, int) and isinstance(delta, int) and delta != 0:
                dtype = str(inputs[0].ty.dtype) if isinstance(inputs[0], relax.Expr) else "int64"
                return relax.op.arange(start, limit, delta, dtype)
            return super()._impl_v12(bb, inputs, attr, params)

    return Range


WEIGHT_DTYPES = (1, 10, 16)  # onnx.TensorProto FLOAT, FLOAT16, BFLOAT16


def is_weight(tensor) -> bool:
    """Float initializers with more than one element are model weights; everything else is a constant."""
    return tensor.data_type in WEIGHT_DTYPES and int(np.prod(tensor.dims)) > 1


def constants_as_nodes(proto):
    """With ``keep_params_in_input=True`` (needed to keep weights as parameters) TVM's frontend turns every
    initializer into a function parameter, and converters that do not look parameters up (Expand, ...)
    then treat shape constants as data: shapes become data-dependent and later Reshapes fail. Turn every
    initializer that is not a weight into a Constant node so the frontend sees it as a constant."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    constants = [t for t in graph.initializer if not is_weight(t)]
    if not constants:
        return out
    keep = [t for t in graph.initializer if is_weight(t)]
    const_names = {t.name for t in constants}
    nodes = [helper.make_node("Constant", [], [t.name], name=f"tvmdm_const/{t.name}", value=t) for t in constants]
    nodes += list(graph.node)
    inputs = [i for i in graph.input if i.name not in const_names]
    del graph.initializer[:], graph.node[:], graph.input[:]
    graph.initializer.extend(keep)
    graph.node.extend(nodes)
    graph.input.extend(inputs)
    return out


def _expand_converter(base):
    """TVM's Expand compares two lists of PrimExprs with ``==`` when the target shape is a ShapeExpr, which
    raises "Cannot use and / or / not operator to Expr" once shapes are bound (legacy BERT exports with
    ``shapes=``). Same ONNX broadcasting, with a structural comparison."""
    import tvm_ffi
    from tvm import relax, tirx

    class Expand(base):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            data, shape = inputs[0], inputs[1]
            if not isinstance(shape, relax.ShapeExpr):
                return super()._impl_v13(bb, inputs, attr, params)
            target = list(shape.values)
            data_shape = [tirx.IntImm("int64", 1)] * (len(target) - data.ty.ndim) + list(data.ty.shape)
            # ONNX Expand broadcasts bidirectionally: a target dim of 1 (or -1) keeps the input's dim.
            out = [d if isinstance(t, tirx.IntImm) and t.value in (-1, 1) else t for d, t in zip(data_shape, target)]
            if len(out) == data.ty.ndim and all(tvm_ffi.structural_equal(a, b) for a, b in zip(out, data_shape)):
                return data
            return relax.op.broadcast_to(data, relax.ShapeExpr(out))

    return Expand


_TVMSCRIPT_ENTRIES = ("tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry", "tvm.relax.script.parser.entry")


def _cheap_stack(context: int = 1):
    """inspect.stack() without the source-file lookups: TVMScript only reads frames, locals and the code
    line of its caller's caller (to spot ``@I.ir_module`` classes)."""
    import inspect
    import linecache
    import sys

    frames, frame = [], sys._getframe(1)
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        line = linecache.getline(filename, lineno) if len(frames) < 4 else ""
        frames.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, [line] if line else None,
                                        0 if line else None))
        frame = frame.f_back
    return frames


def speed_up_tvmscript_parsing() -> None:
    """TVMScript's decorators call ``inspect.stack()``, which looks up the source file of every frame; for
    frames of frozen importlib modules that means a scan of sys.modules per frame. Importing
    ``tvm.s_tir.tensor_intrin`` (every MetaSchedule build worker does) then takes 20-50 s instead of ~1 s,
    and most of a tuning trial goes there. Give those modules a stack() that skips the lookups."""
    import importlib
    import inspect
    import types

    proxy = types.ModuleType("inspect")
    proxy.__dict__.update(inspect.__dict__)
    proxy.stack = _cheap_stack
    for name in _TVMSCRIPT_ENTRIES:
        importlib.import_module(name).inspect = proxy


def reset_metaschedule_logging() -> None:
    """MetaSchedule's logging setup lists the names of the handlers already on its logger; a handler without
    a name (one added by another library or a test harness, or left by a previous tuning run in the same
    process) makes it fail with "'NoneType' object has no attribute 'format'". It re-creates its own
    handlers, so clear them before each tuning run."""
    import logging

    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


class ConverterError(Exception):
    """A converter failed on one node; the message names the op and the node."""


def _naming_convert_operator(original):
    """TVM's converter errors do not say which node failed (it prints the inputs to stdout instead):
    re-raise them naming the op and the node."""

    def convert_operator(self, op_name, inputs, attrs, opset):
        try:
            return original(self, op_name, inputs, attrs, opset)
        except Exception as err:  # noqa: BLE001 - any converter failure is reported the same way
            node = attrs.get("tvm_custom", {}).get("name", "?")
            first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise ConverterError(f"cannot convert {op_name} node {node!r} (opset {opset}): {first}") from err

    return convert_operator


def patch_onnx_frontend() -> None:
    """Install the converter fixes into TVM's ONNX frontend (idempotent).

    ``_get_convert_map`` reads the module-level converter classes on every call, so replacing the module
    attributes is enough; subclasses keep every other opset version of the original converters."""
    global _PATCHED
    if _PATCHED:
        return
    fe = _frontend()
    ORIGINAL_CONVERTERS.update(ConstantOfShape=fe.ConstantOfShape, Range=fe.Range, Expand=fe.Expand)
    fe.ConstantOfShape = _constant_of_shape_converter(fe.ConstantOfShape)
    fe.Range = _range_converter(fe.Range)
    fe.Expand = _expand_converter(fe.Expand)
    fe.ONNXGraphImporter._convert_operator = _naming_convert_operator(fe.ONNXGraphImporter._convert_operator)
    _PATCHED = True


# Gradients 0.27's relax.transform.Gradient lacks (it fails with "has no FPrimalGradient"). Registered once,
# only where TVM has none, so an upgrade that adds its own keeps it (and test_compat shows that it did).
GRADIENTS_ADDED: list[str] = []


def register_missing_gradients() -> None:
    import math

    import tvm
    from tvm import relax
    from tvm.relax.op.base import register_gradient

    def missing(name: str) -> bool:
        return tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None and name not in GRADIENTS_ADDED

    def const(value, like):
        return relax.const(value, like.ty.dtype)

    if missing("relax.erf"):
        @register_gradient("relax.erf")
        def erf_grad(orig_var, orig_call, output_grad, ctx):  # d erf(x) = 2/sqrt(pi) exp(-x^2)
            x = orig_call.args[0]
            return [output_grad * const(2.0 / math.sqrt(math.pi), x) * relax.op.exp(relax.op.negative(x * x))]

        GRADIENTS_ADDED.append("relax.erf")

    if missing("relax.nn.gelu"):
        @register_gradient("relax.nn.gelu")
        def gelu_grad(orig_var, orig_call, output_grad, ctx):  # Phi(x) + x phi(x)
            x = orig_call.args[0]
            cdf = const(0.5, x) * (const(1.0, x) + relax.op.erf(x * const(1 / math.sqrt(2.0), x)))
            pdf = const(1 / math.sqrt(2 * math.pi), x) * relax.op.exp(const(-0.5, x) * x * x)
            return [output_grad * (cdf + x * pdf)]

        GRADIENTS_ADDED.append("relax.nn.gelu")

    if missing("relax.nn.layer_norm"):
        @register_gradient("relax.nn.layer_norm")
        def layer_norm_grad(orig_var, orig_call, output_grad, ctx):
            # Recompute the statistics (cheaper than keeping them: one pass over x); the usual closed form
            # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * gamma.
            x, gamma, _ = orig_call.args
            ndim = x.ty.ndim
            axes = [int(a) % ndim for a in orig_call.attrs.axes]
            batch_axes = [a for a in range(ndim) if a not in axes]

            def normalized():
                centered = ctx.normalize(x - relax.op.mean(x, axes, keepdims=True))
                var = relax.op.mean(centered * centered, axes, keepdims=True)
                rstd = ctx.normalize(relax.op.rsqrt(var + const(float(orig_call.attrs.epsilon), x)))
                return ctx.normalize(centered * rstd), rstd

            xhat, rstd = normalized()
            dxhat = ctx.normalize(output_grad * gamma)
            dx = rstd * (dxhat - relax.op.mean(dxhat, axes, keepdims=True)
                         - xhat * relax.op.mean(dxhat * xhat, axes, keepdims=True))
            # The parameter gradients normalize x on their own and sum [dy * xhat, dy] (side by side) in one
            # reduction: one kernel reading dy once, the paper's BSB, apart from BLNRD (dx) so that its fusion
            # makes each one kernel (tvmdm.backward_kernels); for stock fusion tvmdm.train shares the
            # statistics again (EliminateCommonSubexpr).
            xhat_params, _ = normalized()
            if len(axes) != 1:
                return [dx, relax.op.sum(output_grad * xhat_params, batch_axes), relax.op.sum(output_grad, batch_axes)]
            both = ctx.normalize(relax.op.sum(relax.op.concat([output_grad * xhat_params, output_grad], axes[0]),
                                              batch_axes))
            halves = ctx.normalize(relax.op.split(both, 2, axis=0))
            return [dx, relax.TupleGetItem(halves, 0), relax.TupleGetItem(halves, 1)]

        GRADIENTS_ADDED.append("relax.nn.layer_norm")

    if missing("relax.strided_slice"):
        @register_gradient("relax.strided_slice")
        def strided_slice_grad(orig_var, orig_call, output_grad, ctx):
            # Unit-stride slices (what exporters write for x[:, 0] and friends): zero-pad the gradient back.
            x = orig_call.args[0]
            shape = [int(d) for d in x.ty.shape]
            pad = [0] * (2 * len(shape))
            axes, begins, ends = ([int(f.value) for f in orig_call.args[i].fields] for i in (1, 2, 3))
            strides = [int(f.value) for f in orig_call.args[4].fields] if len(orig_call.args) > 4 else [1] * len(axes)
            for axis, begin, end, stride in zip(axes, begins, ends, strides):
                if stride != 1:
                    raise NotImplementedError(f"gradient of strided_slice with stride {stride} (axis {axis})")
                size = shape[axis]
                begin = min(max(begin + size if begin < 0 else begin, 0), size)
                end = min(max(end + size if end < 0 else end, 0), size)
                pad[2 * axis], pad[2 * axis + 1] = begin, size - end
            return [relax.op.nn.pad(output_grad, pad), *[no_grad(a) for a in orig_call.args[1:]]]

        GRADIENTS_ADDED.append("relax.strided_slice")

    if missing("relax.einsum"):
        @register_gradient("relax.einsum")
        def einsum_grad(orig_var, orig_call, output_grad, ctx):
            # Two operands, each index once per operand (what attention written as einsum uses, e.g.
            # "bhqd,bhkd->bhqk"): d/dA of einsum(a,b->o) is einsum(o,b->a)(grad, B), and likewise for B.
            subscripts = str(orig_call.attrs.subscripts).replace(" ", "")
            inputs, out = subscripts.split("->")
            operands = list(orig_call.args[0].fields)
            terms = inputs.split(",")
            if len(terms) != 2 or any(len(set(t)) != len(t) for t in terms) or \
                    any(set(a) - set(out) - set(b) for a, b in (terms, terms[::-1])):
                raise NotImplementedError(f"gradient of einsum {subscripts!r}: only two operands without "
                                          "repeated or operand-only indices")
            a, b = terms
            grads = [relax.op.einsum([output_grad, operands[1]], f"{out},{b}->{a}"),
                     relax.op.einsum([output_grad, operands[0]], f"{out},{a}->{b}")]
            return [relax.Tuple(grads)]

        GRADIENTS_ADDED.append("relax.einsum")

    if missing("relax.squeeze"):
        @register_gradient("relax.squeeze")
        def squeeze_grad(orig_var, orig_call, output_grad, ctx):  # the dropped unit axes come back
            return [relax.op.reshape(output_grad, orig_call.args[0].ty.shape)]

        GRADIENTS_ADDED.append("relax.squeeze")

    # Ops whose results carry no gradient (integer-valued masks and labels) but that Gradient still asks
    # about when their output meets a differentiable value in a multiply; no_grad itself is one of them.
    for name in ("relax.one_hot", "relax.grad.no_grad"):
        if missing(name):
            register_gradient(name)(lambda orig_var, orig_call, output_grad, ctx:
                                    [no_grad(a) for a in orig_call.args])
            GRADIENTS_ADDED.append(name)


def no_grad(expr):
    from tvm.relax.op.grad import no_grad as mark

    return mark(expr)


def flatten_take_indices():
    """Relax pass: take(x, idx) with 0-d or N-d indices -> reshape(take(x, reshape(idx, [-1])), ...).

    0.27's legalization of take's gradient (relax.grad.take_backward) asserts 1-d indices; embedding
    lookups of [batch, seq] token ids are 2-d, x[:, 0] picks by a 0-d index. Same values forward; the gradient then legalizes."""
    import tvm
    from tvm import relax

    take_op = tvm.ir.Op.get("relax.take")

    @relax.expr_functor.mutator
    class Flatten(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not call.op.same_as(take_op) or len(call.args[1].ty.shape) == 1:
                return call
            data, indices = call.args
            axis = int(call.attrs.axis) % data.ty.ndim
            shape = [int(d) for d in call.ty.shape]
            flat = self.builder_.emit(relax.op.take(data, relax.op.reshape(indices, [-1]), axis=axis,
                                                     mode=str(call.attrs.mode)))
            return relax.op.reshape(flat, shape)

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.FlattenTakeIndices")
    def flatten(mod, _ctx):
        mutator = Flatten(mod)
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gv, mutator.visit_expr(func))
        return mutator.builder_.get()

    return flatten


def cross_entropy(logits, labels, classes: int, ignore_index: int, dtype: str = "float32"):
    """Mean cross-entropy of logits [N, C] against int labels [N], skipping ``ignore_index``, as torch's.

    Not ``nn.nll_loss``: 0.27 legalizes its gradient (nll_loss_backward) by reading class weights at the
    label (``T_full[y[i]]``), out of bounds for an ignored label (-100), and counts every row in the mean's
    denominator once the constant weights are inlined: the gradients of a batch with ignored labels came out
    scaled by valid/total. one_hot of an ignored label is an all-zero row, so this form needs no special case.
    An all-ignored batch gives loss 0 (torch gives nan)."""
    from tvm import relax

    log_probs = relax.op.nn.log_softmax(logits, axis=-1)
    # labels carry no gradient: no_grad keeps Gradient from asking for one_hot's (it has none)
    one_hot = no_grad(relax.op.astype(relax.op.one_hot(labels, 1.0, 0.0, classes), dtype))
    picked = relax.op.multiply(one_hot, log_probs)
    valid = no_grad(relax.op.astype(relax.op.not_equal(labels, relax.const(ignore_index, "int64")), dtype))
    count = relax.op.maximum(relax.op.sum(valid), relax.const(1.0, dtype))
    return relax.op.divide(relax.op.negative(relax.op.sum(picked)), count)


_TRAINING_PATCHED = False


def patch_relax_training() -> None:
    """Fix relax.training for users who build trainers with it (tvmdm's own step uses train_graph instead).

    - Optimizer (Adam, SGD, ...) keeps the parameters' dtype as a type object (T.float32) and then fails
      in ``const(lr, dtype)``: "Could not convert T.float32 to a NumPy dtype". Keep its name ("float32").
    - SetupTrainer fails unless every function's ``global_symbol`` equals its GlobalVar name, which modules
      built with ``BlockBuilder.add_func`` or renamed functions lack. Set it first."""
    global _TRAINING_PATCHED
    if _TRAINING_PATCHED:
        return
    import tvm
    from tvm import relax
    from tvm.relax.training import optimizer as opt_mod
    from tvm.relax.training.setup_trainer import SetupTrainer

    original_set = opt_mod.Optimizer._set_params_and_dtype

    def set_params_and_dtype(self, params):
        original_set(self, params)
        if self.dtype is not None and not isinstance(self.dtype, str):
            self.dtype = str(tvm.DataType(self.dtype.dtype)) if hasattr(self.dtype, "dtype") else str(self.dtype)

    opt_mod.Optimizer._set_params_and_dtype = set_params_and_dtype

    # SetupTrainer is a @module_pass class: the wrapper's __init__ closes over the class with transform_module
    trainer_cls = next(c.cell_contents for c in SetupTrainer.__init__.__closure__
                       if isinstance(c.cell_contents, type) and hasattr(c.cell_contents, "transform_module"))
    original_transform = trainer_cls.transform_module

    def transform_module(self, mod, ctx):
        mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                mod[gv] = func.with_attr("global_symbol", gv.name_hint)
        return original_transform(self, mod, ctx)

    trainer_cls.transform_module = transform_module
    _TRAINING_PATCHED = True


def fast_math():
    """relax.transform.FastMathTransform (softmax, exp, erf, tanh -> TVM's polynomial versions) reads
    ``call.op.name`` of every call and raises AttributeError on calls of a GlobalVar, which every module has
    once FuseOpsByPattern made its composite functions. Same rewrite, skipping calls that are not of an Op."""
    import tvm
    from tvm import relax
    from tvm.relax.transform.fast_math import FastMathCodeGenerator

    @relax.expr_functor.mutator
    class OpCallsOnly(FastMathCodeGenerator._cls):
        def visit_call_(self, call):
            if not isinstance(call.op, tvm.ir.Op):
                return relax.PyExprMutator.visit_call_(self, call)
            return super().visit_call_(call)

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.FastMath")
    def transform(mod, _ctx):
        rewriter = OpCallsOnly(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()

    return transform


# --- the AVX512-BF16 dot product -------------------------------------------------------------------------
# TVM 0.27's LLVM backend cannot emit vdpbf16ps from TIR: its bf16 legalization rewrites every bfloat16 vector
# into fp32 (and skipping it crashes the code generator on bfloat16 buffers), and LLVM 22's intrinsic only takes
# <32 x bfloat> operands, which call_llvm_pure_intrin on integer vectors does not bitcast to (the LLVM verifier
# rejects the call). So the kernels call this LLVM function on int32 vectors holding the bf16 pairs; it is linked
# into the module through the ``pragma_import_llvm`` loop annotation and inlined (alwaysinline).
DPBF16PS_FUNCTION = "tvmdm_dpbf16ps"
DPBF16PS_LLVM = r"""
define internal <16 x float> @tvmdm_dpbf16ps(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) #0 {
  %ab = bitcast <16 x i32> %a to <32 x bfloat>
  %bb = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %ab, <32 x bfloat> %bb)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
attributes #0 = { alwaysinline nounwind "target-features"="+avx512f,+avx512bf16" }
"""
