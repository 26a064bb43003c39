"""Tiny HF transformers models exported to ONNX the ways users do it (torch's legacy and dynamo exporters).

Weights are seeded and perturbed (so the exporter's de-duplication of identical initializers is exercised
only where a test wants it).
"""
from __future__ import annotations

import os

import numpy as np

FAMILIES = {
    # name: (transformers class, config class, takes token_type_ids)
    "bert": ("BertModel", "BertConfig", True),
    "roberta": ("RobertaModel", "RobertaConfig", False),
    "distilbert": ("DistilBertModel", "DistilBertConfig", False),
    "albert": ("AlbertModel", "AlbertConfig", True),
    "electra": ("ElectraModel", "ElectraConfig", True),
    "bert-seqcls": ("BertForSequenceClassification", "BertConfig", True),
    "bert-mlm": ("BertForMaskedLM", "BertConfig", True),
    "roberta-seqcls": ("RobertaForSequenceClassification", "RobertaConfig", False),
    "distilbert-mlm": ("DistilBertForMaskedLM", "DistilBertConfig", False),
}

VOCAB = 96
BATCH, SEQ = 2, 8


def tiny_config(config_cls: str):
    import transformers

    cls = getattr(transformers, config_cls)
    if config_cls == "DistilBertConfig":
        return cls(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)
    extra = {"embedding_size": 16} if config_cls == "AlbertConfig" else {}
    return cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64, num_labels=3, **extra)


def tiny_model(family: str, seed: int = 0):
    import torch
    import transformers

    model_cls, config_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(tiny_config(config_cls)).eval()
    with torch.no_grad():  # LayerNorm weights start identical (ones/zeros): make every parameter distinct
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def input_names(family: str) -> list[str]:
    return ["input_ids", "attention_mask"] + (["token_type_ids"] if FAMILIES[family][2] else [])


def sample_inputs(family: str, batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(3, VOCAB, size=(batch, seq)).astype(np.int64)}
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[batch - 1, seq // 2:] = 0  # pad the tail of the last row
    feeds["attention_mask"] = mask
    if FAMILIES[family][2]:
        feeds["token_type_ids"] = (np.arange(seq)[None, :] >= seq // 2).astype(np.int64).repeat(batch, 0)
    return feeds


def export(family: str, path: str, *, dynamo: bool, dynamic: bool, opset: int) -> str:
    """Export ``family`` to ``path`` the way a user would; returns the path."""
    import torch

    model = tiny_model(family)
    names = input_names(family)
    feeds = {k: torch.from_numpy(v) for k, v in sample_inputs(family).items()}
    model.config.return_dict = False  # outputs as a tuple, named below
    with torch.no_grad():
        n_out = len(model(**feeds))
    out_names = [f"output_{i}" for i in range(n_out)]
    kwargs = dict(input_names=names, output_names=out_names, opset_version=opset, dynamo=dynamo)
    if dynamic and dynamo:
        batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=64)
        kwargs["dynamic_shapes"] = {n: {0: batch, 1: seq} for n in names}
    elif dynamic:
        kwargs["dynamic_axes"] = {n: {0: "batch", 1: "seq"} for n in names}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if dynamo:
        torch.onnx.export(model, (), path, kwargs=feeds, external_data=False, **kwargs)
    else:
        # The legacy (TorchScript) exporter binds kwargs by position, which transformers' forward() signatures
        # do not allow: users wrap the model with a positional forward, as here.
        torch.onnx.export(_Positional(model, names), tuple(feeds[n] for n in names), path, **kwargs)
    return path


def _Positional(model, names):
    import torch

    class Positional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return self.model(**dict(zip(names, args)))

    return Positional()
