"""What a compiled training step carries between calls, free of the compiler: the AdamW rule, dynamic loss
scaling and the dropout masks' recipe. The runtime (``tvmdm.runtime.train_step``) loads a step with these and
TVM's runtime alone; the training-graph builders (``tvmdm.train``) import them from here."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from tvmdm.core.errors import InputError

BENCH_LR = 1e-4  # what the training benchmarks (here and on a lent GPU) train with
IGNORE_INDEX = -100  # label value that cross_entropy skips, as in torch and HF (padding, unmasked MLM tokens)


def check_learning_rate(lr) -> float:
    if not (isinstance(lr, (int, float, np.floating)) and math.isfinite(lr) and lr >= 0.0):
        raise InputError(f"the learning rate must be a finite number >= 0, got {lr!r}")
    return float(lr)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW's update rule (decoupled weight decay, bias-corrected moments)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self):  # torch.optim.AdamW's rules: a NaN here would turn every weight into NaN
        check_learning_rate(self.lr)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(math.isfinite(b) and 0.0 <= b < 1.0 for b in self.betas)):
            raise InputError(f"AdamW betas must be two numbers in [0, 1), got {self.betas!r}")
        if not (math.isfinite(self.eps) and self.eps >= 0.0):
            raise InputError(f"AdamW eps must be a finite number >= 0, got {self.eps!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise InputError(f"AdamW weight_decay must be a finite number >= 0, got {self.weight_decay!r}")

    def scalars(self, step: int, lr: float | None = None) -> list[np.ndarray]:
        """The per-step inputs of train_step for 1-based ``step``: [decay, step_size, bc2_sqrt]."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        values = (1.0 - lr * self.weight_decay, lr / (1.0 - b1 ** step), math.sqrt(1.0 - b2 ** step))
        return [np.array(v, dtype=np.float32) for v in values]


@dataclasses.dataclass
class LossScaler:
    """Dynamic loss scaling as torch.cuda.amp.GradScaler does it: the loss is multiplied by ``scale`` before the
    backward pass (small fp16 gradients stay representable), the gradients divided by it before the update; a
    step whose gradients are not all finite is skipped and halves the scale; ``interval`` finite steps in a
    row double it."""

    scale: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    good_steps: int = 0
    skipped: int = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.interval:
            self.scale *= self.growth
            self.good_steps = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DropoutSite:
    name: str  # e.g. "attention_probs.0"
    shape: tuple
    dtype: str


def masks_for_step(sites: list[DropoutSite], p: float, seed: int, step: int, world: int = 1,
                   rank: int = 0) -> list[np.ndarray]:
    """The keep-masks of training step ``step`` (1-based): 0 with probability p, else 1/(1-p).

    Data parallel (``world`` processes, this one ``rank``): the masks of the whole batch are drawn (every site's
    first axis is the batch) and this process takes its slice, so N processes drop what one process on the
    full batch would."""
    rng = np.random.default_rng([seed, step])
    scale = np.float32(1.0 / (1.0 - p))
    masks = []
    for site in sites:
        rows = site.shape[0]
        full = rng.random((rows * world, *site.shape[1:])) >= p
        masks.append((full[rank * rows:(rank + 1) * rows] * scale).astype(site.dtype))
    return masks


@dataclasses.dataclass(frozen=True)
class DropoutConfig:
    """What a training step needs to draw its masks: probability, seed and the sites' shapes."""

    p: float = 0.0
    seed: int = 0
    sites: tuple = ()
    world: int = 1  # data parallel: processes sharing each batch, and this one's place among them
    rank: int = 0

    def masks(self, step: int) -> list[np.ndarray]:
        return masks_for_step(list(self.sites), self.p, self.seed, step, self.world, self.rank) if self.sites \
            else []

    def to_json(self) -> dict:
        return {"p": self.p, "seed": self.seed, "sites": [[s.name, list(s.shape), s.dtype] for s in self.sites]}

    @classmethod
    def from_json(cls, d: dict) -> "DropoutConfig":
        return cls(d["p"], d["seed"], tuple(DropoutSite(n, tuple(shape), dtype) for n, shape, dtype in d["sites"]))
