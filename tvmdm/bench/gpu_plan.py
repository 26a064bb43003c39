"""What a lent GPU runs, and what each part may cost: shared by the machine that compiles (``gpu_prepare``) and
the one that runs (``gpu_run``), so both read one list.

A lent GPU comes for minutes in all (starting it included), one call at a time, each call carrying at most
64 MiB. So everything that can happen here does: every configuration is compiled here for the GPU's arch and
exported (the CUDA code in the library), and the GPU machine runs it with TVM's runtime alone. Weights travel
as a recipe: the embedded models are rebuilt there from their config and seed (``tvmdm.models``), checked
against the digest taken here. Costs are seconds on the GPU machine (loading, checking, timing every system of
the configuration), estimated generously; ``gpu_run`` skips, in plan order, what no longer fits its budget.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

CARRY_LIMIT = 64 * 2**20  # what one device call may carry: working tree + carried paths
TREE_MARGIN = 20 * 2**20  # kept for the repository's own files, which travel with every call
DEFAULT_ARCH = "sm_90"  # H100 / H200
PREFLIGHT_MODEL = "bert-tiny-layer"  # runs in well under a second: proves kernels really run on the GPU


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    model: str  # an embedded model (tvmdm.models.DEFAULT_MODELS): its weights are rebuilt on the GPU machine
    precision: str  # "fp32" or "fp16"
    batch: int
    seq: int
    train: bool = False  # the compiled training step (mse loss, AdamW) instead of inference
    cost_s: float = 20.0  # expected seconds on the GPU machine for this configuration, torch's systems included
    compile_s: float = 0.0  # expected seconds of torch.compile (inductor) of its baseline; 0: no torch.compile

    @property
    def name(self) -> str:
        kind = "train" if self.train else "infer"
        return f"{self.model}-{kind}-{self.precision}-b{self.batch}s{self.seq}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"name": self.name}

    @classmethod
    def from_json(cls, d: dict) -> "GpuConfig":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


# In the order they run: the base layer first (the first targets), whole BERT-base, then training.
# torch.compile runs where the issue sets a target against it (fp16 inference).
DEFAULT_PLAN = (
    GpuConfig("bert-base-layer", "fp16", 8, 128, cost_s=25, compile_s=30),
    GpuConfig("bert-base-layer", "fp32", 8, 128, cost_s=20),
    GpuConfig("bert-base-layer", "fp16", 1, 128, cost_s=20, compile_s=30),
    GpuConfig("bert-base", "fp16", 8, 128, cost_s=45, compile_s=60),
    GpuConfig("bert-base", "fp16", 1, 128, cost_s=40, compile_s=60),
    GpuConfig("bert-base", "fp32", 8, 128, cost_s=40),
    GpuConfig("bert-base-layer", "fp16", 8, 128, train=True, cost_s=30),
    GpuConfig("bert-base-layer", "fp32", 8, 128, train=True, cost_s=30),
)
# A plan of the tiny layer, for llvm: how the whole path is tested on a machine without a GPU.
TINY_PLAN = (
    GpuConfig(PREFLIGHT_MODEL, "fp32", 2, 8, cost_s=5),
    GpuConfig(PREFLIGHT_MODEL, "fp32", 2, 8, train=True, cost_s=5),
)
PLANS = {"default": DEFAULT_PLAN, "tiny": TINY_PLAN}
PREFLIGHT = GpuConfig(PREFLIGHT_MODEL, "fp32", 2, 8, cost_s=10)
STARTUP_S = 30  # unpacking the runtime, importing torch
DEFAULT_BUDGET_S = 540  # one device call runs at most 600 s: the rest is the margin for the call's own start


def weights_digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: the GPU machine's rebuilt weights must be
    the very ones this machine compiled and checked with."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{value.dtype}:{value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def config_cost(config: GpuConfig, torch_compile: bool) -> float:
    """Expected GPU seconds of one configuration (with torch.compile: its compile too)."""
    return config.cost_s + (config.compile_s if torch_compile else 0)


def plan_cost(plan, torch_compile: bool) -> float:
    """Seconds the whole plan is expected to take on the GPU machine, start and preflight included."""
    return STARTUP_S + PREFLIGHT.cost_s + sum(config_cost(c, torch_compile) for c in plan)


def fits(plan, seconds: float, torch_compile: bool) -> tuple[list, list]:
    """(configurations that fit in ``seconds`` in plan order, those left out): what a run with that much time
    left after its preflight does. A part too big is passed over, a later smaller one still taken."""
    taken, left_out, spent = [], [], 0.0
    for config in plan:
        cost = config_cost(config, torch_compile)
        if spent + cost <= seconds:
            taken.append(config)
            spent += cost
        else:
            left_out.append(config)
    return taken, left_out
