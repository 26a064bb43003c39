"""``tvmdm train``: a short training run on a synthetic sequence-classification task, with progress and a plot.

The task: random token sequences, each holding one marker token (id 1 + its class) at a random position; the
model must find it (attention) and name the class. A BERT classifier learns it in tens of steps, so a falling
loss curve shows the compiled step trains, not only that it runs.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from tvmdm.core.extras import require

DEFAULT_MODEL = "bert-small"


def classifier_model(name: str = DEFAULT_MODEL, num_labels: int = 2):
    """An embedded full BERT with a sequence-classification head (seeded weights)."""
    from tvmdm import models

    if name != DEFAULT_MODEL:
        raise KeyError(f"the training demo builds a classifier on 'bert-small'; got {name!r} (give an ONNX "
                       "BertForSequenceClassification export as MODEL to train another)")
    return models.build_bert(models.DEFAULT_MODELS[name][1], num_labels=num_labels)


def synthetic_batch(step, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One batch for ``step`` (a TrainStep): its inputs at their compiled shapes plus int64 ``labels``."""
    shapes = {s.name: list(s.shape) for s in step.inputs}
    if "input_ids" not in shapes:
        raise KeyError(f"the synthetic task needs a model taking input_ids; this one takes {sorted(shapes)}")
    vocab = step.index_bounds.get("input_ids", (100, None))[0]
    num_labels = int(step.outputs[0].shape[-1])
    rows, length = shapes["input_ids"]
    ids = rng.integers(1 + num_labels, vocab, size=(rows, length)).astype(np.int64)
    lengths = rng.integers(length // 2, length + 1, size=rows)  # padded tails of random length
    labels = rng.integers(0, num_labels, size=rows)
    ids[np.arange(rows), (rng.random(rows) * lengths).astype(np.int64)] = 1 + labels  # the marker
    batch = {"input_ids": ids}
    for name, shape in shapes.items():
        if "mask" in name:
            batch[name] = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
        elif name != "input_ids":
            batch[name] = np.zeros(shape, np.int64)
    batch["labels"] = labels.astype(np.int64).reshape(step.target_spec.shape)
    return batch


class StepProgress:
    """One line per update: bar, step count, loss (and its running mean), time per step, ETA. The first step
    loads the weights onto the device and packs them (seconds on BERT-base): time per step and ETA count the
    steps after it, so the ETA is what is left, not an average with the start-up."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.start = time.perf_counter()
        self.first_done = None  # when step 1 ended

    def update(self, done: int, loss: float, mean: float) -> None:
        now = time.perf_counter()
        if done == 1 or self.first_done is None:
            self.first_done, per_step = now, now - self.start
        else:
            per_step = (now - self.first_done) / (done - 1)
        width = 24
        bar = "#" * int(width * done / self.total)
        timing = (f"first step {per_step * 1e3:.0f} ms (loads the weights)" if done == 1 and self.total > 1 else
                  f"{per_step * 1e3:.0f} ms/step  ETA {per_step * (self.total - done):.0f}s")
        line = f"[{bar:.<{width}}] {done}/{self.total} steps  loss {loss:.4f} (mean of last 10 {mean:.4f})  {timing}"
        self.stream.write(line + ("\r" if self.stream.isatty() and done < self.total else "\n"))
        self.stream.flush()


def train_loop(step, steps: int, seed: int = 0, progress: StepProgress | None = None) -> list[float]:
    """``steps`` training steps on fresh synthetic batches; returns the loss of each."""
    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        losses.append(step.step(synthetic_batch(step, rng)))
        if progress is not None:
            progress.update(i + 1, losses[-1], float(np.mean(losses[-10:])))
    return losses


def plot_losses(losses: list[float], path: str, title: str) -> str:
    require("plot", "a loss plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=1, alpha=0.5, label="loss")
    window = min(10, len(losses))
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1:], smooth, lw=2, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_train(model=None, *, steps: int = 50, batch: int = 8, seq: int = 32, lr: float = 1e-3, seed: int = 0,
              target: str = "llvm", plot: str | None = None, json_path: str | None = None,
              export: str | None = None, dropout: float = 0.0, checkpoint=False, stream=None,
              tuning_logs="shipped") -> list[float]:
    from tvmdm.core.training import AdamW
    from tvmdm.train.step import compile_train_step

    from tvmdm.runtime.inputs import check_positive

    check_positive("steps", steps)
    stream = stream or sys.stderr
    proto = classifier_model() if model is None else model
    label = DEFAULT_MODEL + " + classifier" if model is None else str(model)
    t0 = time.perf_counter()
    step = compile_train_step(proto, loss="cross_entropy", optimizer=AdamW(lr=lr), target=target, batch=batch,
                              seq=seq, dropout=dropout, seed=seed, checkpoint=checkpoint, tuning_logs=tuning_logs)
    stream.write(f"compiled the training step of {label} (batch {batch}, seq {seq}, {len(step.weight_names)} "
                 f"weight tensors, dropout {dropout}, checkpoint {checkpoint or 'off'}) in "
                 f"{time.perf_counter() - t0:.1f}s; peak live tensors {step.memory['peak_live'] / 2**20:.1f} MiB\n")
    losses = train_loop(step, steps, seed, StepProgress(steps, stream))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    stream.write(f"loss {first:.4f} -> {last:.4f} (mean of the first and last 5 steps)\n")
    if plot:
        stream.write(f"wrote {plot_losses(losses, plot, f'tvmdm training step: {label}, batch {batch}, seq {seq}')}\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": label, "batch": batch, "seq": seq, "lr": lr, "losses": losses}, f, indent=1)
        stream.write(f"wrote {json_path}\n")
    if export:
        stream.write(f"wrote {step.export(export)}\n")
    return losses
