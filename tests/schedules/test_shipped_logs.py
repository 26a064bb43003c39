"""The tuning log shipped for the BERT-base layer applies at compile: to our embedded layer and to the same
layer exported by a user from HF transformers (the kernels are structurally the same)."""
import os

import pytest

import tvmdm
from schedules.logs import shipped_logs
from schedules.logs import tuned_on_this_cpu
from tvmdm.analysis.profile import call_sites
from tvmdm.core.target import make_target

SHAPES = {"hidden_states": [8, 128, 768], "attention_mask": [8, 128]}

# The logs were tuned on a Zen 4 with AVX-512; on a CPU without it compile leaves them out (test_packed).
pytestmark = pytest.mark.skipif(not shipped_logs(make_target("llvm")), reason="no shipped log tuned for this CPU")
# On another CPU model with as wide vectors (a Sapphire Rapids VM) the contractions take schedules.packed and the
# records serve every other kernel.
TUNED_HERE = any(tuned_on_this_cpu(d, make_target("llvm")) for d in shipped_logs(make_target("llvm")))


def untuned(compiled, names) -> list[str]:
    """Kernels among ``names`` left to the default schedule: neither a record nor a hand-written schedule (the
    packed contractions, their weight packing and, where the records come from another CPU model, the
    attention kernels)."""
    packed = {k for k in compiled.kernels if "packed_gemm" in k or k.startswith("pack_")}
    assert bool(packed) != TUNED_HERE, sorted(packed)
    assert packed <= set(compiled.hand_kernels), sorted(packed - set(compiled.hand_kernels))
    return sorted(set(names) - set(compiled.tuned_kernels) - set(compiled.hand_kernels))


def test_every_kernel_of_the_base_layer_is_tuned():  # stock fusion (the paper level: the test below)
    compiled = tvmdm.compile(tvmdm.default_model("bert-base-layer"), shapes=SHAPES, fusion="tvm")
    assert untuned(compiled, compiled.kernels) == []
    result = compiled.check(tvmdm.random_inputs(compiled, batch=8, seq=128))
    assert result.ok, str(result)


def test_log_applies_to_a_users_hf_export(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    config = transformers.BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    layer = BertLayer(config).eval()

    class WithMask(torch.nn.Module):  # what a user writes to export a layer with a (batch, seq) 0/1 mask
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, hidden_states, attention_mask):
            extended = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
            return self.layer(hidden_states, attention_mask=extended)[0]

    path = str(tmp_path / "layer.onnx")
    torch.onnx.export(WithMask(), (torch.randn(8, 128, 768), torch.ones(8, 128, dtype=torch.long)), path,
                      input_names=["hidden_states", "attention_mask"], output_names=["output"], opset_version=17,
                      dynamo=False)
    compiled = tvmdm.compile(path, shapes=SHAPES, fusion="tvm")  # the stock log's kernels, reached from an export
    left = untuned(compiled, compiled.kernels)
    # Every contraction, softmax and LayerNorm kernel reuses the records; only export-specific glue differs.
    assert all("matmul" not in k and k not in ("softmax", "layer_norm") for k in left), left
    # (softmax and LayerNorm: hand-written row schedules, ahead of the records)
    assert len(compiled.tuned_kernels) >= (9 if TUNED_HERE else 5)
    assert compiled.check(tvmdm.random_inputs(compiled, batch=8, seq=128)).ok
    assert "bert-base-layer-llvm" in [os.path.basename(d) for d in shipped_logs("llvm")]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_paper_fusion_kernels_are_tuned_in_each_layout(layout):
    """tuning_logs/bert-base-layer-paper-llvm covers the paper fusion's own kernels (merged QKV, SM, context,
    BDRLN, the layouts' transposes); the FFN kernel it shares with stock fusion takes the stock record."""
    compiled = tvmdm.compile(tvmdm.default_model("bert-base-layer"), shapes=SHAPES, fusion="paper", layout=layout)
    assert untuned(compiled, call_sites(compiled.mod)) == []
    result = compiled.check(tvmdm.random_inputs(compiled, batch=8, seq=128))
    assert result.ok, str(result)
