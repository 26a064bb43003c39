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
import os
import time

import numpy as np
import tvm
from tvm import relax

from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT
from tvmdm.transform.graph_rewrites import paper_graph_rewrites
from tvmdm.transform.index_guards import guard_gathers, too_long_for_positions
from tvmdm.train import graph as train_graph
from tvmdm.train.dropout import DropoutConfig, strip_exported_dropout
from tvmdm.core.errors import InputError, ShapeError, TvmdmError
from tvmdm.runtime.feeds import as_mapping, device_tensor, host_array
from tvmdm.runtime.runner import ModelRunner
from tvmdm.core.spec import TensorSpec
from tvmdm.core.precision import check_precision
from tvmdm.core.target import make_target

log = logging.getLogger("tvmdm")

FORMAT = "tvmdm-train-step"
VERSION = 1
TARGET_KEYS = ("labels", "target")  # the batch key holding the loss target (HF calls it labels)
AdamW = train_graph.AdamW
LossScaler = train_graph.LossScaler
IGNORE_INDEX = train_graph.IGNORE_INDEX


class TrainStep(ModelRunner):
    """A compiled training step. ``step(batch)`` trains once and returns the loss; ``run(inputs)`` is inference
    with the current weights; ``gradients(batch)`` gives the loss and every weight's gradient (no update)."""

    def __init__(self, executable, *, inputs, outputs, params, target_kind, index_bounds, target_spec: TensorSpec,
                 optimizer: AdamW, loss_name: str, moments=None, step_count: int = 0,
                 dropout: DropoutConfig = DropoutConfig(), loss_scaler: LossScaler | None = None):
        super().__init__(executable, inputs=inputs, outputs=outputs, params=params, target_kind=target_kind,
                         index_bounds=index_bounds)
        self.target_spec = target_spec
        self.optimizer = optimizer
        self.loss_name = loss_name
        self.lr = optimizer.lr  # settable: a schedule changes it between steps without recompiling
        self.step_count = step_count
        self.dropout = dropout
        self.loss_scaler = loss_scaler  # dynamic loss scaling (fp16): its scale is an input of every call
        self.memory: dict[str, int] = {}  # bytes: "planned" by relax, "peak_live" tensors (checkpoint.py)
        self.checkpoint = False
        zeros = {n: np.zeros_like(v) for n, v in self._host_params.items()}
        moments = moments or {"m": zeros, "v": zeros}
        self._host_moments = {k: [np.asarray(moments[k][n], order="C") for n in self._host_params] for k in "mv"}
        self._moments = None

    def _ensure_loaded(self):
        super()._ensure_loaded()
        if self._moments is None:
            self._moments = {k: [tvm.runtime.tensor(a, self.device) for a in arrays]
                             for k, arrays in self._host_moments.items()}

    @property
    def weight_names(self) -> list[str]:
        return list(self._host_params)

    def _split_batch(self, batch) -> tuple[list, "tvm.runtime.Tensor"]:
        batch = as_mapping(batch)  # a dict, a BatchEncoding; numpy, torch, DLPack or list values
        keys = [k for k in TARGET_KEYS if k in batch]
        if len(keys) != 1:
            raise InputError(f"a batch needs the loss target under exactly one of {list(TARGET_KEYS)} "
                             f"({self.target_spec.dtype} {list(self.target_spec.shape)}); got keys {sorted(batch)}")
        target = host_array(keys[0], batch[keys[0]])
        spec = self.target_spec
        if not isinstance(target, np.ndarray) or str(target.dtype) != spec.dtype or \
                tuple(target.shape) != tuple(spec.shape):
            got = f"{target.dtype} {list(target.shape)}" if isinstance(target, np.ndarray) else type(target).__name__
            raise InputError(f"batch[{keys[0]!r}] must be {spec.dtype} {list(spec.shape)} for the "
                             f"{self.loss_name} loss, got {got}")
        if self.loss_name == "cross_entropy":
            self._check_labels(keys[0], target)
        checked = self.check_inputs({k: v for k, v in batch.items() if k != keys[0]})
        self._ensure_loaded()
        # the inputs, then the dropout masks of the coming step (the same ones step() and gradients() use)
        args = [device_tensor(checked[n], self.device) for n in self.input_names] + \
            [tvm.runtime.tensor(m, self.device) for m in self.dropout.masks(self.step_count + 1)]
        return args, tvm.runtime.tensor(np.asarray(target, order="C"), self.device)

    def _check_labels(self, key: str, labels: np.ndarray) -> None:
        """Class ids in [0, classes) or IGNORE_INDEX: one_hot of any other id is a row of zeros, a silent loss."""
        classes = int(self.outputs[0].shape[-1])
        bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= classes))]
        if bad.size:
            raise InputError(f"batch[{key!r}] holds class id {int(bad.flat[0])}: the output {self.outputs[0].name!r} "
                             f"has {classes} classes, so ids must be in [0, {classes}) or {IGNORE_INDEX} (ignored)")

    def _scale_args(self, scale: float | None = None) -> list:
        """The loss-scale input of a loss-scaled module (``scale``, or the scaler's): nothing otherwise."""
        if self.loss_scaler is None:
            return []
        value = self.loss_scaler.scale if scale is None else scale
        return [tvm.runtime.tensor(np.array(value, dtype=np.float32), self.device)]

    def step(self, batch: dict) -> float:
        """One training step (forward, loss, backward, AdamW update) on ``batch``; returns the loss. With loss
        scaling, a step whose gradients overflow changes nothing but the scale (as torch's GradScaler)."""
        args, target = self._split_batch(batch)
        result = self._vm["train_step"](*args, *self._scale_args(), target, *self._params, *self._moments["m"],
                                        *self._moments["v"], *self._update_scalars())
        if self.loss_scaler is None:
            self._take_update(list(result[1:]))
        else:
            finite = float(result[len(result) - 1].numpy()) == 0.0
            if finite:
                self._take_update([result[i] for i in range(1, len(result) - 1)])
            self.loss_scaler.update(finite)
        return float(result[0].numpy())

    def gradients(self, batch: dict) -> tuple[float, dict[str, np.ndarray]]:
        """Loss and the gradient of every weight on ``batch``, without updating anything."""
        loss, grads = self.device_gradients(batch)
        return float(loss.numpy()), {n: g.numpy() for n, g in zip(self.weight_names, grads)}

    def device_gradients(self, batch: dict) -> tuple["tvm.runtime.Tensor", list]:
        """Loss and gradients as device tensors (in ``weight_names`` order), for ``apply_gradients``: what a
        data-parallel step exchanges between them (tvmdm.distributed)."""
        args, target = self._split_batch(batch)
        # Scale 1: plain gradients (a data-parallel step all-reduces and applies them as they are).
        loss, grads = self._vm["loss_and_grads"](*args, *self._scale_args(1.0), target, *self._params)
        if self.loss_scaler is not None:
            loss = loss[1]  # (scaled loss, loss)
        return loss, list(grads)

    def apply_gradients(self, grads: list) -> None:
        """The AdamW update of the weights with ``grads`` (device tensors, ``weight_names`` order): one step."""
        self._ensure_loaded()
        result = self._vm["apply_update"](*self._params, *grads, *self._moments["m"], *self._moments["v"],
                                          *self._update_scalars())
        self._take_update(list(result))

    def _update_scalars(self) -> list:
        """AdamW's per-step inputs (decay, step size, bias correction) for the coming step, on the device."""
        lr = train_graph.check_learning_rate(self.lr)
        return [tvm.runtime.tensor(s, self.device) for s in self.optimizer.scalars(self.step_count + 1, lr)]

    def _take_update(self, updated: list) -> None:
        n = len(self._params)
        self._params = updated[:n]
        self._moments = {"m": updated[n:2 * n], "v": updated[2 * n:3 * n]}
        self.step_count += 1

    def loss(self, batch: dict) -> float:
        return self.gradients(batch)[0]

    def state_dict(self) -> dict[str, np.ndarray]:
        """Weights and optimizer state as numpy arrays: weights/<name>, adam_m/<name>, adam_v/<name>, step."""
        state = {f"weights/{n}": v for n, v in self.params().items()}
        moments = self._host_moments if self._moments is None else \
            {k: [t.numpy() for t in ts] for k, ts in self._moments.items()}
        for kind, prefix in (("m", "adam_m/"), ("v", "adam_v/")):
            state.update({prefix + n: a for n, a in zip(self.weight_names, moments[kind])})
        state["step"] = np.array(self.step_count, dtype=np.int64)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (all keys, same shapes and dtypes)."""
        expected = set(self.state_dict())
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or extra:
            raise InputError(f"state dict does not match this training step: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}")
        for name, value in state.items():
            want = self.state_dict_spec(name)
            if name != "step" and (tuple(np.shape(value)) != want.shape or str(np.asarray(value).dtype) != want.dtype):
                raise InputError(f"state[{name!r}] is {np.asarray(value).dtype} {list(np.shape(value))}, expected "
                                 f"{want.dtype} {list(want.shape)}")
        self._host_params = {n: np.asarray(state[f"weights/{n}"], order="C") for n in self.weight_names}
        self._host_moments = {k: [np.asarray(state[f"adam_{k}/{n}"], order="C") for n in self.weight_names]
                              for k in "mv"}
        self.step_count = int(state["step"])
        self._params = self._moments = None
        if self._vm is not None:
            self._params = [tvm.runtime.tensor(v, self.device) for v in self._host_params.values()]
            self._ensure_loaded()

    def state_dict_spec(self, name: str) -> TensorSpec:
        weight = self._host_params[name.split("/", 1)[1]] if "/" in name else np.zeros((), np.int64)
        return TensorSpec(name, tuple(weight.shape), str(weight.dtype))

    def export(self, path: "str | os.PathLike") -> str:
        """Write the step (compiled code, weights, optimizer state) to one file for ``load_train_step``."""
        from tvmdm.runtime.artifact import write_bundle

        manifest = {
            "format": FORMAT, "version": VERSION, "target_kind": self.target_kind,
            "inputs": [s.to_json() for s in self.inputs], "outputs": [s.to_json() for s in self.outputs],
            "index_bounds": {k: list(v) for k, v in self.index_bounds.items()},
            "target": self.target_spec.to_json(), "loss": self.loss_name, "lr": self.lr,
            "memory": self.memory, "checkpoint": self.checkpoint, "dropout": self.dropout.to_json(),
            "optimizer": {"lr": self.optimizer.lr, "betas": list(self.optimizer.betas), "eps": self.optimizer.eps,
                          "weight_decay": self.optimizer.weight_decay},
            "loss_scaler": self.loss_scaler.to_json() if self.loss_scaler else None,
            "amx": self.uses_amx,
        }
        return write_bundle(path, manifest, self._executable, self.state_dict())


def load_train_step(path: "str | os.PathLike") -> TrainStep:
    """Load a step written by ``TrainStep.export``: training resumes where it stopped (no onnx needed)."""
    from tvmdm.runtime.artifact import manifest_entries, read_bundle

    manifest, lib, state = read_bundle(path, FORMAT, VERSION)
    with manifest_entries(path):
        opt = manifest["optimizer"]
        names = [k.split("/", 1)[1] for k in state if k.startswith("weights/")]
        ts = TrainStep(lib, inputs=[TensorSpec.from_json(s) for s in manifest["inputs"]],
                       outputs=[TensorSpec.from_json(s) for s in manifest["outputs"]],
                       params={n: state[f"weights/{n}"] for n in names}, target_kind=manifest["target_kind"],
                       index_bounds={k: tuple(v) for k, v in manifest["index_bounds"].items()},
                       target_spec=TensorSpec.from_json(manifest["target"]),
                       optimizer=AdamW(opt["lr"], tuple(opt["betas"]), opt["eps"], opt["weight_decay"]),
                       loss_name=manifest["loss"],
                       moments={k: {n: state[f"adam_{k}/{n}"] for n in names} for k in "mv"},
                       step_count=int(state["step"]), dropout=DropoutConfig.from_json(manifest["dropout"]),
                       loss_scaler=LossScaler(**manifest["loss_scaler"]) if manifest.get("loss_scaler") else None)
        ts.lr, ts.memory, ts.checkpoint = manifest["lr"], manifest["memory"], manifest["checkpoint"]
        ts.uses_amx = bool(manifest.get("amx", False))
    return ts


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
                   fusion: str = DEFAULT_FUSION, layout: str = DEFAULT_LAYOUT, loss_scaling: bool = False):
    """The training stages before fusion: import with static shapes, split trainable weights, build the
    training module (train_graph). With fusion="paper" the paper's graph rewrites (merged QKV, transposes
    folded into the attention contractions) come before Gradient, so the backward pass has them too.
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
        mod = paper_graph_rewrites(layout)(mod)
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
    t0 = time.perf_counter()
    imported, mod, trainable, sites = training_graph(model, loss=loss, optimizer=optimizer, shapes=shapes,
                                                     batch=batch, seq=seq, checkpoint=checkpoint, dropout=dropout,
                                                     fusion=fusion, layout=layout, loss_scaling=scaler is not None)
    graph_seconds = time.perf_counter() - t0
    options = make_options(tvm_target, fusion=fusion, layout=layout, precision=precision, tuning_logs=tuning_logs,
                           training=True)
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
