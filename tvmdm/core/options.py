"""Options: every choice a compile makes, taken once at the API and carried to every stage.

``tvmdm.compile``, ``compile_train_step``, the tuner and the CLI build one ``Options`` (through
``tvmdm.build.options.make_options``, which also resolves the tuning logs) and hand it to fusion
(``tvmdm.transform.fuse``), the schedule stage (``schedules.pipeline``) and ``relax.build``; no stage has
defaults of its own for these.
"""
from __future__ import annotations

import dataclasses

from tvmdm.core.precision import check_precision

FUSION_LEVELS = ("none", "tvm", "paper")
DEFAULT_FUSION = "paper"
# Where the attention's contractions read Q/K/V and write the context: "bshd" where the projections put them (no
# transposes), "bhsd" head-major copies (the ONNX graph's transposes); "qkv=bshd,ctx=bhsd" and the like mix them,
# per tensor group, as the layout search may choose (tvmdm.analysis.layout_search).
ATTENTION_LAYOUTS = ("bshd", "bhsd")
DEFAULT_LAYOUT = "bshd"
LAYOUTS = ("bshd", "bhsd", "qkv=bshd,ctx=bhsd", "qkv=bhsd,ctx=bshd")


def parse_layout(layout: str) -> dict[str, str]:
    """"bshd" -> {"qkv": "bshd", "ctx": "bshd"}; "qkv=bshd,ctx=bhsd" -> {"qkv": "bshd", "ctx": "bhsd"}."""
    if "=" not in layout:
        parts = {"qkv": layout, "ctx": layout}
    else:
        try:
            parts = dict(item.split("=", 1) for item in layout.split(","))
        except ValueError:
            parts = {}
    if set(parts) != {"qkv", "ctx"} or not set(parts.values()) <= set(ATTENTION_LAYOUTS):
        raise ValueError(f"unknown attention layout {layout!r}; choose one of {list(LAYOUTS)}")
    return parts


def layout_name(qkv: str, ctx: str) -> str:
    return qkv if qkv == ctx else f"qkv={qkv},ctx={ctx}"


def check_fusion(fusion: str) -> str:
    if fusion not in FUSION_LEVELS:
        raise ValueError(f"unknown fusion level {fusion!r}; choose one of {list(FUSION_LEVELS)}")
    return fusion


@dataclasses.dataclass(frozen=True)
class Options:
    """The settings of one compile.

    target: a ``tvm.target.Target`` (tvmdm.core.target.make_target makes one from "llvm", "cuda", ...).
    fusion: one of FUSION_LEVELS. layout: the attention layout under fusion="paper" (LAYOUTS).
    precision: "fp32", "bf16" or "fp16" (tvmdm.core.precision). training: a training step (its weights change
    every step: nothing is lifted to load time, the backward pass's own kernels are fused).
    tuning_logs: the log directories whose records the schedule stage applies, in order.
    packed_lanes: the fp32 contractions run on weights packed in panels this wide (schedules.packed), because
    no log tuned on this CPU model serves them; None: records or the default schedules take them.
    batched_attention: the paper level keeps the attention's contractions batched matmuls, for matrix units
    (tvmdm.core.target.attention_on_matrix_units; on CPUs for a training step only: CPU inference runs the
    attention as one tile kernel, tvmdm.transform.tile_attention).
    """

    target: object
    fusion: str = DEFAULT_FUSION
    layout: str = DEFAULT_LAYOUT
    precision: str = "fp32"
    training: bool = False
    tuning_logs: tuple = ()
    packed_lanes: int | None = None
    batched_attention: bool = False

    def __post_init__(self):
        check_fusion(self.fusion)
        parse_layout(self.layout)
        check_precision(self.precision, self.target_kind)
        object.__setattr__(self, "tuning_logs", tuple(self.tuning_logs or ()))

    @property
    def target_kind(self) -> str:
        return self.target.kind.name

    @property
    def on_cpu(self) -> bool:
        return self.target_kind == "llvm"

    @property
    def records_first(self) -> bool:
        """Whether tuning records outrank the hand-written attention and row schedules: yes unless the fp32
        contractions are packed, which happens exactly when the records were tuned on another CPU model (or
        serve no symbolic shape): then our kernels go first and the records only fill in."""
        return self.packed_lanes is None

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)
