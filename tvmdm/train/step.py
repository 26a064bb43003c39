"""The compiled training step: forward + loss + backward + AdamW in one compiled function, state on the device.

    step = tvmdm.compile_train_step("bert.onnx", loss="cross_entropy", optimizer=tvmdm.AdamW(lr=1e-4),
                                    shapes={"input_ids": [8, 128], "attention_mask": [8, 128]})
    for batch in data:                      # batch: the model's inputs + "labels" (or "target")
        loss = step.step(batch)
    step.export("step.tar")                 # tvmdm.load_train_step("step.tar") resumes it, without onnx

import -> training graph (train_graph: loss, Gradient, AdamW) -> fuse -> schedule -> relax.build, the same
stages as inference. Weights, Adam moments and the step count stay on the device between steps.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import tvm
from tvm import relax

from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT
from tvmdm.transform.graph_rewrites import paper_graph_rewrites
from tvmdm.transform.index_guards import guard_gathers, too_long_for_positions
from tvmdm.train import graph as train_graph
from tvmdm.train.dropout import strip_exported_dropout
from tvmdm.core.errors import InputError, ShapeError, TvmdmError
from tvmdm.core.spec import TensorSpec
from tvmdm.core.training import AdamW, DropoutConfig, LossScaler
from tvmdm.runtime.train_step import TARGET_KEYS, TrainStep
from tvmdm.core.precision import check_precision
from tvmdm.core.target import make_target

log = logging.getLogger("tvmdm")


def _loss_scaler(loss_scale, precision: str) -> LossScaler | None:
    if loss_scale is None:
        return LossScaler() if precision == "fp16" else None
    if loss_scale is False:
        return None
    if loss_scale == "dynamic":
        return LossScaler()
    if isinstance(loss_scale, LossScaler):
        return dataclasses.replace(loss_scale)
    raise ValueError(f"loss_scale must be None, False, 'dynamic' or a LossScaler, got {loss_scale!r}")


def _split_trainable(imported) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Bind non-float initializers (index tables, shape constants) into main as constants: only float
    weights are trained. Returns the module, whose main takes (inputs..., trainable...), and those weights."""
    main = imported.mod["main"]
    n_in = len(imported.inputs)
    frozen = {var: imported.params[name] for var, name in zip(main.params[n_in:], imported.params)
              if not np.issubdtype(imported.params[name].dtype, np.floating)}
    trainable = {name: v for name, v in imported.params.items() if np.issubdtype(v.dtype, np.floating)}
    mod = imported.mod
    if frozen:
        mod = relax.transform.BindParams("main", {k: tvm.runtime.tensor(v) for k, v in frozen.items()})(mod)
    return mod, trainable


def training_graph(model, *, loss="cross_entropy", optimizer: AdamW | None = None, shapes: dict | None = None,
                   batch: int | None = None, seq: int | None = None, checkpoint=False, dropout: float = 0.0,
                   fusion: str = DEFAULT_FUSION, layout: str = DEFAULT_LAYOUT, loss_scaling: bool = False,
                   batched_attention: bool = False):
    """The training stages before fusion: import with static shapes, split trainable weights, build the
    training module (train_graph). With fusion="paper" the paper's graph rewrites (merged QKV, transposes
    folded into the attention contractions; ``batched_attention``: the attention kept as batched matmuls, for
    matrix units) come before Gradient, so the backward pass has them too.
    Returns (imported model, IRModule, trainable weights by name, dropout sites)."""
    from onnx_import import import_onnx
    from onnx_import.importer import onnx_input_specs
    from onnx_import.loader import load_model_proto
    from tvmdm.train.checkpoint import MODES
    from tvmdm.runtime.inputs import bind_batch_seq

    if checkpoint and checkpoint not in MODES:
        raise ValueError(f"unknown checkpoint mode {checkpoint!r}; choose one of {list(MODES)} (or False)")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout}")
    proto, source = load_model_proto(model)
    shapes = dict(shapes or {})
    if batch is not None or seq is not None:  # bind the symbolic (batch, seq) axes of every other input
        shapes = bind_batch_seq(onnx_input_specs(proto), shapes, batch, seq)
    imported = import_onnx(proto, shapes=shapes)
    imported.source = source
    unbound = [s for s in imported.inputs if any(isinstance(d, str) for d in s.shape)]
    if unbound:
        s = unbound[0]
        raise InputError(f"{source}: training needs static shapes, but input {s.name!r} has shape "
                         f"[{', '.join(map(str, s.shape))}]: pass batch= and seq=, or shapes={{{s.name!r}: [...]}}")
    mod, trainable = _split_trainable(imported)
    too_long = too_long_for_positions(mod)
    if too_long:
        raise ShapeError(f"{source}: {too_long}")
    mod = guard_gathers(check=False)(strip_exported_dropout()(mod))
    if not trainable:
        raise TvmdmError(f"{source}: the model has no float initializers to train")
    mod, trainable, tied = train_graph.tie_transposed_copies(mod, len(imported.inputs), trainable)
    for copy, weight in tied.items():
        log.info("%s: initializer %r is the transpose of %r (an exporter's copy of a tied weight): trained as one "
                 "tensor", source, copy, weight)
    if fusion == "paper":
        mod = paper_graph_rewrites(layout, batched_attention)(mod)
    try:
        mod, sites = train_graph.training_module(mod, len(imported.inputs), loss, optimizer or AdamW(), checkpoint,
                                                 dropout=bool(dropout), loss_scaling=loss_scaling)
    except (tvm.error.InternalError, RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[-1]
        raise TvmdmError(f"{source}: cannot differentiate the model: {first}") from None
    if fusion != "paper" and not checkpoint:
        # LayerNorm's gradient normalizes x twice (for the paper's BLNRD and BSB kernels): share it again.
        # Not with checkpointing, whose recomputed regions the same pass would merge back into the forward.
        mod = relax.transform.EliminateCommonSubexpr()(mod)
    return imported, mod, trainable, sites


def compile_train_step(model, *, loss="cross_entropy", optimizer: AdamW | None = None, target="llvm",
                       shapes: dict | None = None, batch: int | None = None, seq: int | None = None,
                       checkpoint=False, dropout: float = 0.0, seed: int = 0, fusion: str = DEFAULT_FUSION,
                       layout: str = DEFAULT_LAYOUT, precision: str = "fp32", loss_scale=None,
                       tuning_logs="shipped") -> TrainStep:
    """Compile a training step for an ONNX model (path or ModelProto): an encoder layer, a full BERT, or a
    BertForSequenceClassification / MaskedLM export. The loss applies to the model's first output.

    loss: "cross_entropy" (int64 labels of the output's shape minus its last axis; -100 is ignored),
    "mse" (a float target of the output's shape) or a callable (output, target) -> scalar Relax expr.
    Training needs static shapes: ``batch``/``seq`` bind the symbolic axes of every input (the first symbolic
    axis is the batch, the next the sequence), ``shapes`` (input name -> shape) binds inputs one by one.
    checkpoint: False, "attention" or "layer": recompute those regions in the backward pass instead of keeping
    their activations (``TrainStep.memory`` gives relax's planned bytes and the peak of live tensors).
    dropout: probability, applied where HF BERT applies it (embeddings, attention probabilities, the dense
    branch of each residual) with keep-masks drawn per step from (seed, step): reproducible (tvmdm.train.dropout).
    fusion / layout: as in tvmdm.compile ("paper": merged QKV and transpose-free attention in forward and
    backward, the paper's pattern kernels).
    precision: "fp32", or "bf16" (CPU): every contraction with a 2-D operand (forward, input gradients, weight
    gradients) reads bf16 operands with fp32 accumulation; weights, Adam moments, the loss and everything else
    stay fp32 (the bf16 copies of the fp32 master weights are made each step); "fp16" (CUDA): the same with
    fp16 operands, and dynamic loss scaling.
    loss_scale: None (dynamic for fp16, off otherwise), "dynamic", a LossScaler (its settings), or False.
    """
    from tvmdm.build.options import make_options
    from tvmdm.build.pipeline import build
    from tvmdm.train.checkpoint import memory_estimate
    from tvmdm.train.fusion import training_fusion

    optimizer = optimizer or AdamW()
    tvm_target = make_target(target)
    check_precision(precision, tvm_target.kind.name)
    scaler = _loss_scaler(loss_scale, precision)
    options = make_options(tvm_target, fusion=fusion, layout=layout, precision=precision, tuning_logs=tuning_logs,
                           training=True)
    t0 = time.perf_counter()
    imported, mod, trainable, sites = training_graph(model, loss=loss, optimizer=optimizer, shapes=shapes,
                                                     batch=batch, seq=seq, checkpoint=checkpoint, dropout=dropout,
                                                     fusion=fusion, layout=layout, loss_scaling=scaler is not None,
                                                     batched_attention=options.batched_attention)
    graph_seconds = time.perf_counter() - t0
    built = build(mod, options, training_fusion(options))
    timings = {"graph": graph_seconds, **built.timings}
    mod, tuned, hand = built.mod, built.tuned_kernels, built.hand_kernels
    log.info("compiled training step of %s for %s: %d kernels (%d tuned, %d by hand); %s", imported.source,
             options.target_kind, len(built.kernel_ops), len(tuned), len(hand),
             ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    target_ty = mod["loss_and_grads"].params[len(imported.inputs) + len(sites) + (scaler is not None)].ty
    step = TrainStep(built.executable, inputs=imported.inputs, outputs=imported.outputs, params=trainable,
                     target_kind=tvm_target.kind.name, index_bounds=imported.index_bounds,
                     target_spec=TensorSpec(TARGET_KEYS[0], tuple(int(d) for d in target_ty.shape), str(target_ty.dtype)),
                     optimizer=optimizer, loss_name=loss if isinstance(loss, str) else "custom",
                     dropout=DropoutConfig(float(dropout), seed, sites), loss_scaler=scaler)
    step.timings, step.mod, step.imported = timings, mod, imported
    step.tuned_kernels, step.hand_kernels = tuned, hand  # scheduled from the logs / by a hand-written schedule
    step.memory = memory_estimate(mod)
    step.checkpoint = checkpoint
    step.precision = precision
    step.uses_amx = built.uses_amx
    return step
