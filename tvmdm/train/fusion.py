"""What a training step adds to fusion (tvmdm.transform.fuse.TrainingFusion): the GELU gradient recomputed from
the pre-activation (paper fusion), every weight gradient read in place as one contraction X^T dY, and the
paper's backward kernels (BLNRD, BSB, BS, BDRB)."""
from __future__ import annotations

from tvmdm.core.options import Options
from tvmdm.train.backward import transposed_left_contractions
from tvmdm.train.backward_kernels import backward_patterns, recompute_gelu_gradient
from tvmdm.transform.fuse import TrainingFusion


def training_fusion(options: Options) -> TrainingFusion:
    paper = options.fusion == "paper"
    return TrainingFusion(before_precision=(recompute_gelu_gradient(),) if paper else (),
                          after_precision=(transposed_left_contractions(),),
                          patterns=tuple(backward_patterns()) if paper else ())
