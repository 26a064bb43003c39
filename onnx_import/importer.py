"""ONNX -> Relax: a checked ModelProto becomes an IRModule whose ``main`` takes (inputs..., params...).

Parameters stay function arguments (not constants) so that later passes (merged QKV, training) still see them
as weights; symbolic dims (batch, seq) stay symbolic unless ``shapes`` binds them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import warnings

import numpy as np
import onnx

from onnx_import.loader import load_model_proto
from tvmdm.core.errors import ShapeError, UnsupportedOperatorError
from tvmdm.core.spec import TensorSpec


@dataclasses.dataclass
class ImportedModel:
    """What the importer hands to the compiler."""

    mod: "object"  # tvm.IRModule; main(inputs..., params...)
    params: dict[str, np.ndarray]  # in the order of main's trailing parameters, keyed by ONNX initializer name
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    source: str  # file path or proto label, for messages
    proto: "onnx.ModelProto | None"  # None when compiled from a Relax IRModule
    # Initializer name -> nodes reading it, for float weights read by more than one node: exporters
    # de-duplicate identical initializers, which would tie those parameters together in training.
    shared_initializers: dict[str, list[str]]
    # Input name -> (rows of the embedding table it indexes, node): out-of-range ids must be refused
    # before the kernel runs (TVM's gather does not check bounds).
    index_bounds: dict[str, tuple[int, str]]


def _onnx_dtype(elem_type: int) -> str:
    return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)))


def onnx_input_specs(proto: onnx.ModelProto) -> list[TensorSpec]:
    initializers = {t.name for t in proto.graph.initializer}
    specs = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim)
        specs.append(TensorSpec(value.name, dims, _onnx_dtype(tensor.elem_type)))
    return specs


def _check_bound_shapes(specs: list[TensorSpec], shapes: dict, source: str) -> None:
    names = {s.name for s in specs}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise ShapeError(f"{source}: shapes given for unknown inputs {unknown}; the model's inputs are {sorted(names)}")
    sizes: dict[str, tuple[int, str]] = {}
    for spec in specs:
        if spec.name not in shapes:
            continue
        shape = [int(d) for d in shapes[spec.name]]
        if len(shape) != len(spec.shape):
            raise ShapeError(f"{source}: input {spec.name!r} has rank {len(spec.shape)} {list(spec.shape)}, "
                             f"but shape {shape} was given")
        for axis, (want, got) in enumerate(zip(spec.shape, shape)):
            if got <= 0:
                raise ShapeError(f"{source}: input {spec.name!r} axis {axis}: size must be positive, got {got}")
            if isinstance(want, int) and want != got:
                raise ShapeError(f"{source}: input {spec.name!r} axis {axis} is fixed to {want} in the model, "
                                 f"but shape {shape} was given")
            if isinstance(want, str) and want != "?":
                seen = sizes.setdefault(want, (got, spec.name))
                if seen[0] != got:
                    raise ShapeError(f"{source}: dim {want!r} bound to {seen[0]} by input {seen[1]!r} but to "
                                     f"{got} by input {spec.name!r}")


def _complete_shapes(specs: list[TensorSpec], shapes: dict) -> dict:
    """``shapes`` plus every input whose symbolic dims the given shapes all bind by name: binding input_ids to
    [8, 128] binds (batch, sequence) and so attention_mask and token_type_ids, as onnxruntime sees one size per
    dim name."""
    sizes = {}
    for spec in specs:
        if spec.name in shapes:
            sizes.update({d: int(v) for d, v in zip(spec.shape, shapes[spec.name]) if isinstance(d, str) and d != "?"})
    completed = dict(shapes)
    for spec in specs:
        named = [d for d in spec.shape if isinstance(d, str)]
        if spec.name not in completed and named and all(d in sizes for d in named):
            completed[spec.name] = [sizes[d] if isinstance(d, str) else d for d in spec.shape]
    return completed


def _still_symbolic(specs: list[TensorSpec], shapes: dict) -> str:
    """What a partial binding left out, for an import that failed on it ("" when all or nothing is bound)."""
    left = [s for s in specs if s.name not in shapes and any(isinstance(d, str) for d in s.shape)]
    if not shapes or not left:
        return ""
    named = ", ".join(f"{s.name!r} {list(s.shape)}" for s in left)
    return (f"; inputs {named} keep symbolic dims that no bound input shares: give their shapes too, or bind "
            f"(batch, seq) for every input (batch=/seq=, --batch/--seq)")


def _past_position_table(proto: onnx.ModelProto, shapes: dict) -> str:
    """Why a bound import failed, where a bound sequence is longer than the model's position table (HF exports
    slice a position-id buffer of that length: the frontend then fails on a broadcast, naming neither)."""
    tables = {t.name: int(t.dims[0]) for t in proto.graph.initializer if len(t.dims) == 2 and "position" in t.name}
    for name, shape in shapes.items():
        for table, rows in tables.items():
            if len(shape) >= 2 and int(shape[-1]) > rows:
                return (f"; input {name!r} is bound to {int(shape[-1])} tokens, but the position table {table!r} "
                        f"has {rows} rows: sequences may be at most {rows} tokens long")
    return ""


def _shared_initializers(proto: onnx.ModelProto) -> dict[str, list[str]]:
    weights = {t.name for t in proto.graph.initializer
               if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
               and len(t.dims) >= 1 and int(np.prod(t.dims)) > 1}
    readers: dict[str, list[str]] = {}
    for node in proto.graph.node:
        for name in set(node.input) & weights:
            readers.setdefault(name, []).append(node.name or node.op_type)
    return {name: nodes for name, nodes in readers.items() if len(nodes) > 1}


def _index_bounds(proto: onnx.ModelProto, input_names: set[str]) -> dict[str, tuple[int, str]]:
    tables = {t.name: t.dims[0] for t in proto.graph.initializer if len(t.dims) >= 1}
    bounds: dict[str, tuple[int, str]] = {}
    for node in proto.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[0] not in tables:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if axis == 0 and node.input[1] in input_names:
            rows = tables[node.input[0]]
            if node.input[1] not in bounds or rows < bounds[node.input[1]][0]:
                bounds[node.input[1]] = (int(rows), node.name or "Gather")
    return bounds


def _check_supported_ops(proto: onnx.ModelProto, source: str) -> None:
    from tvm.relax.frontend.onnx import onnx_frontend

    known = set(onnx_frontend._get_convert_map()) | {"If", "Constant"}
    missing: dict[str, list[str]] = {}
    for node in proto.graph.node:
        if node.op_type not in known:
            missing.setdefault(f"{node.domain + '.' if node.domain else ''}{node.op_type}", []).append(
                node.name or "(unnamed)")
    if missing:
        listing = "; ".join(f"{op} at node(s) {', '.join(nodes[:3])}{' ...' if len(nodes) > 3 else ''}"
                            for op, nodes in sorted(missing.items()))
        raise UnsupportedOperatorError(f"{source}: unsupported ONNX operator(s): {listing}")


def _spec_from_type(name: str, ty) -> TensorSpec:
    from tvm import tirx

    if getattr(ty, "shape", None) is None:
        raise ShapeError(f"{name}: shape unknown after import ({ty}); bind the input shapes with shapes=")
    shape = tuple(int(d) if isinstance(d, tirx.IntImm) else str(d) for d in ty.shape.values)
    return TensorSpec(name, shape, str(ty.dtype))


def import_onnx(model: "str | os.PathLike | onnx.ModelProto", shapes: dict | None = None) -> ImportedModel:
    """Load, check and convert an ONNX model. ``shapes`` maps input names to concrete shapes to bind;
    unbound symbolic dims stay symbolic (one compiled module then serves many (batch, seq))."""
    from tvm import relax

    from onnx_import import frontend_fixes

    frontend_fixes.patch_onnx_frontend()
    proto, source = load_model_proto(model)
    onnx_inputs = onnx_input_specs(proto)
    shapes = dict(shapes or {})
    _check_bound_shapes(onnx_inputs, shapes, source)
    shapes = _complete_shapes(onnx_inputs, shapes)
    _check_supported_ops(proto, source)
    tvm_proto = frontend_fixes.constants_as_nodes(proto)
    # TVM prints a line before re-raising converter errors and warns about dynamic dims: we report both ourselves.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            mod = relax.frontend.onnx.from_onnx(tvm_proto, shape_dict={k: list(v) for k, v in shapes.items()},
                                                dtype_dict={s.name: s.dtype for s in onnx_inputs},
                                                keep_params_in_input=True)
        except frontend_fixes.ConverterError as err:
            hint = _still_symbolic(onnx_inputs, shapes) or _past_position_table(proto, shapes)
            if hint:
                raise ShapeError(f"{source}: {err}{hint}") from None
            raise UnsupportedOperatorError(f"{source}: {err}") from None
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    n_in = len(onnx_inputs)
    param_names = [t.name for t in tvm_proto.graph.initializer]
    values = detached.get("main", [])
    if len(values) != len(param_names) or len(main.params) != n_in + len(values):
        raise RuntimeError(f"{source}: importer lost track of parameters ({len(values)} values, "
                           f"{len(param_names)} initializers, {len(main.params)} function params)")
    params = {name: v.numpy() for name, v in zip(param_names, values)}
    inputs = [_spec_from_type(spec.name, var.ty) for spec, var in zip(onnx_inputs, main.params[:n_in])]
    out_ty = main.ret_ty
    out_types = list(out_ty.fields) if isinstance(out_ty, relax.TupleType) else [out_ty]
    outputs = [_spec_from_type(o.name, ty) for o, ty in zip(proto.graph.output, out_types)]
    return ImportedModel(mod, params, inputs, outputs, source, proto, _shared_initializers(proto),
                         _index_bounds(proto, {s.name for s in onnx_inputs}))


def import_relax(mod, params: dict | None = None) -> ImportedModel:
    """Wrap a Relax IRModule as an ImportedModel. ``main`` takes the inputs, then the parameters: either the
    module carries them (``from_onnx(..., keep_params_in_input=True)`` style "params" attribute) or ``params``
    maps the trailing parameter names to arrays. Outputs are named output_0, output_1, ..."""
    from tvm import relax

    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ShapeError("IRModule has no 'main' function")
    main = mod["main"]
    if main.attrs is not None and "params" in main.attrs:
        n_in = int(main.attrs["num_input"])
        mod, detached = relax.frontend.detach_params(mod)
        main = mod["main"]
        params = {var.name: v.numpy() for var, v in zip(main.params[n_in:], detached["main"])}
    params = dict(params or {})
    n_in = len(main.params) - len(params)
    names = [var.name for var in main.params[n_in:]]
    if n_in < 0 or sorted(names) != sorted(params):
        raise ShapeError(f"IRModule main's trailing parameters {names} do not match the params given "
                         f"{sorted(params)}")
    inputs = [_spec_from_type(var.name, var.ty) for var in main.params[:n_in]]
    out_ty = main.ret_ty
    out_types = list(out_ty.fields) if isinstance(out_ty, relax.TupleType) else [out_ty]
    outputs = [_spec_from_type(f"output_{i}", ty) for i, ty in enumerate(out_types)]
    return ImportedModel(mod, {n: params[n] for n in names}, inputs, outputs, "<IRModule>", None, {}, {})
