"""Embedded default models: BERT graphs written as ONNX by our own builder, with seeded random weights.

There is no model hub here, so the default models are generated from a config. The graphs follow what
torch's ONNX exporter writes for HF ``BertLayer``/``BertModel`` (MatMul + Add bias, Reshape/Transpose into
heads, Div by sqrt(d), additive mask, Softmax, erf-GELU, LayerNormalization), so they exercise the same import
path as a user's export. The batch and sequence dims are symbolic ("batch", "seq"); ``default_shapes`` gives
the sizes the demo and benchmarks bind.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17


@dataclasses.dataclass(frozen=True)
class BertConfig:
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    layers: int = 1
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    layer_norm_eps: float = 1e-12
    batch: int = 8
    seq: int = 128
    seed: int = 0
    activation: str = "gelu"  # the FFN's: "gelu" (BERT) or "relu" (the paper's BRD variant)

    def __post_init__(self):
        if self.activation not in ("gelu", "relu"):
            raise ValueError(f"BertConfig.activation must be 'gelu' or 'relu', got {self.activation!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Name -> (what it is, config). "bert-base-layer" is the paper's unit of work; "bert-small" and "bert-base"
# (bert-base-uncased's size: 12 layers, 110M parameters) are whole models (embeddings + encoder).
DEFAULT_MODELS = {
    "bert-base-layer": ("BERT-base encoder layer", BertConfig()),
    "bert-base": ("BERT-base (embeddings + 12 layers, 110M parameters)", BertConfig(layers=12)),
    "bert-small": (
        "small full BERT (embeddings + 2 layers)",
        BertConfig(hidden=256, heads=4, ffn=1024, layers=2, vocab=1000, max_positions=128, batch=4, seq=64),
    ),
    "bert-tiny-layer": ("tiny encoder layer for tests", BertConfig(hidden=32, heads=2, ffn=64, batch=2, seq=8)),
}


class _GraphBuilder:
    """Accumulates nodes and initializers; every weight is drawn from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def weight(self, name: str, shape, std=0.02, mean=0.0) -> str:
        # A mean plus noise for every tensor (LayerNorm gammas too): identical initializers would be
        # de-duplicated by exporters and tie parameters during training.
        value = (mean + std * self.rng.standard_normal(shape)).astype(np.float32)
        self.initializers.append(onnx.numpy_helper.from_array(value, name))  # raw bytes: float_data is 30x slower
        return name

    def const(self, value, dtype=np.int64) -> str:
        self._count += 1
        name = f"const_{self._count}"
        array = np.asarray(value, dtype=dtype)
        self.initializers.append(onnx.numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs, scope: str, **attrs) -> str:
        self._count += 1
        out = f"{scope}/{op_type}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"/{out}", **attrs))
        return out

    def linear(self, x: str, scope: str, fan_in: int, fan_out: int) -> str:
        # Add(bias, MatMul), in that order, as torch's exporter writes nn.Linear: the fused kernels are then
        # structurally the same as a user's export and the same tuning records apply to both.
        w = self.weight(f"{scope}.weight", [fan_in, fan_out])
        b = self.weight(f"{scope}.bias", [fan_out])
        return self.op("Add", [b, self.op("MatMul", [x, w], scope)], scope)

    def layer_norm(self, x: str, scope: str, hidden: int, eps: float) -> str:
        gamma = self.weight(f"{scope}.weight", [hidden], std=0.02, mean=1.0)
        beta = self.weight(f"{scope}.bias", [hidden])
        return self.op("LayerNormalization", [x, gamma, beta], scope, axis=-1, epsilon=eps)


def _encoder_layer(g: _GraphBuilder, x: str, mask: str, cfg: BertConfig, prefix: str) -> str:
    """One BERT encoder layer: self-attention + output LayerNorm, FFN with erf-GELU + LayerNorm."""
    h, nh, d = cfg.hidden, cfg.heads, cfg.head_dim
    split_heads = g.const([0, 0, nh, d])  # Reshape's 0 keeps (batch, seq) symbolic
    merge_heads = g.const([0, 0, h])

    def heads(t: str, name: str, perm) -> str:
        proj = g.linear(t, f"{prefix}.attention.self.{name}", h, h)
        return g.op("Transpose", [g.op("Reshape", [proj, split_heads], prefix)], prefix, perm=perm)

    q = heads(x, "query", [0, 2, 1, 3])
    k = heads(x, "key", [0, 2, 3, 1])
    v = heads(x, "value", [0, 2, 1, 3])
    scores = g.op("Mul", [g.op("MatMul", [q, k], prefix), g.const(1.0 / math.sqrt(d), np.float32)], prefix)
    probs = g.op("Softmax", [g.op("Add", [scores, mask], prefix)], prefix, axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v], prefix)], prefix, perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, merge_heads], prefix)
    attn = g.linear(ctx, f"{prefix}.attention.output.dense", h, h)
    attn = g.layer_norm(g.op("Add", [attn, x], prefix), f"{prefix}.attention.output.LayerNorm", h,
                        cfg.layer_norm_eps)

    inter = g.linear(attn, f"{prefix}.intermediate.dense", h, cfg.ffn)
    if cfg.activation == "relu":
        act = g.op("Relu", [inter], prefix)
    else:  # GELU as torch exports it: x * 0.5 * (1 + erf(x / sqrt(2)))
        erf = g.op("Erf", [g.op("Div", [inter, g.const(math.sqrt(2.0), np.float32)], prefix)], prefix)
        act = g.op("Mul", [g.op("Mul", [inter, g.op("Add", [erf, g.const(1.0, np.float32)], prefix)], prefix),
                           g.const(0.5, np.float32)], prefix)
    out = g.linear(act, f"{prefix}.output.dense", cfg.ffn, h)
    return g.layer_norm(g.op("Add", [out, attn], prefix), f"{prefix}.output.LayerNorm", h, cfg.layer_norm_eps)


def _additive_mask(g: _GraphBuilder, attention_mask: str) -> str:
    """(batch, seq) 0/1 int64 mask -> (batch, 1, 1, seq) float additive mask, as HF computes it."""
    m = g.op("Cast", [g.op("Unsqueeze", [attention_mask, g.const([1, 2])], "mask")], "mask", to=TensorProto.FLOAT)
    return g.op("Mul", [g.op("Sub", [g.const(1.0, np.float32), m], "mask"),
                        g.const(np.finfo(np.float32).min, np.float32)], "mask")


def _finish(g: _GraphBuilder, name: str, inputs, output: str, out_name: str, out_shape) -> onnx.ModelProto:
    g.nodes.append(helper.make_node("Identity", [output], [out_name], name=f"/{out_name}"))
    graph = helper.make_graph(
        g.nodes, name, inputs,
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, list(out_shape))],
        initializer=g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="tvmdm")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build_encoder_layer(cfg: BertConfig = BertConfig()) -> onnx.ModelProto:
    """A single encoder layer taking ``hidden_states`` (batch, seq, hidden) and ``attention_mask`` (batch, seq)."""
    g = _GraphBuilder(cfg.seed)
    inputs = [
        helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", cfg.hidden]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
    ]
    out = _encoder_layer(g, "hidden_states", _additive_mask(g, "attention_mask"), cfg, "layer.0")
    return _finish(g, "bert_encoder_layer", inputs, out, "output", ["batch", "seq", cfg.hidden])


def build_bert(cfg: BertConfig, num_labels: int | None = None) -> onnx.ModelProto:
    """Embeddings (word + position + token type, LayerNorm) followed by ``cfg.layers`` encoder layers.
    With ``num_labels``, HF's BertForSequenceClassification head follows (pooler on the first token: dense +
    tanh, then a classifier) and the output is ``logits`` (batch, num_labels)."""
    g = _GraphBuilder(cfg.seed)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    word = g.op("Gather", [g.weight("embeddings.word_embeddings.weight", [cfg.vocab, cfg.hidden]), "input_ids"],
                "embeddings", axis=0)
    seq_len = g.op("Squeeze", [g.op("Slice", [g.op("Shape", ["input_ids"], "embeddings"), g.const([1]),
                                                g.const([2])], "embeddings")], "embeddings")
    positions = g.op("Range", [g.const(0), seq_len, g.const(1)], "embeddings")
    pos = g.op("Gather", [g.weight("embeddings.position_embeddings.weight", [cfg.max_positions, cfg.hidden]),
                          positions], "embeddings", axis=0)
    tok = g.op("Gather", [g.weight("embeddings.token_type_embeddings.weight", [cfg.type_vocab, cfg.hidden]),
                          "token_type_ids"], "embeddings", axis=0)
    x = g.op("Add", [g.op("Add", [word, tok], "embeddings"), pos], "embeddings")
    x = g.layer_norm(x, "embeddings.LayerNorm", cfg.hidden, cfg.layer_norm_eps)
    mask = _additive_mask(g, "attention_mask")
    for i in range(cfg.layers):
        x = _encoder_layer(g, x, mask, cfg, f"encoder.layer.{i}")
    if num_labels is None:
        return _finish(g, "bert", inputs, x, "last_hidden_state", ["batch", "seq", cfg.hidden])
    first = g.op("Gather", [x, g.const(0)], "pooler", axis=1)  # [CLS] token: (batch, hidden)
    pooled = g.op("Tanh", [g.linear(first, "pooler.dense", cfg.hidden, cfg.hidden)], "pooler")
    logits = g.linear(pooled, "classifier", cfg.hidden, num_labels)
    return _finish(g, "bert_classifier", inputs, logits, "logits", ["batch", num_labels])


def default_model(name: str) -> onnx.ModelProto:
    """Build one of ``DEFAULT_MODELS`` by name."""
    if name not in DEFAULT_MODELS:
        raise KeyError(f"unknown default model {name!r}; choose one of {sorted(DEFAULT_MODELS)}")
    cfg = DEFAULT_MODELS[name][1]
    return build_bert(cfg) if is_whole_model(name) else build_encoder_layer(cfg)


def is_whole_model(name: str) -> bool:
    """A default model with embeddings (inputs: token ids), not a lone encoder layer (inputs: hidden states)."""
    return not name.endswith("-layer")


def default_dims(name: str) -> dict[str, int]:
    """The (batch, seq) sizes the demo and benchmarks use for a default model."""
    cfg = DEFAULT_MODELS[name][1]
    return {"batch": cfg.batch, "seq": cfg.seq}
