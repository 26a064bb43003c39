"""HF transformers models exported to ONNX the ways users do it (torch's legacy and dynamo exporters).

No model hub here: models are built from configs with seeded random weights, perturbed so that no two
initializers are identical (the exporters would de-duplicate them and tie parameters in training). Sizes:
"tiny" (hidden 32, 2 layers: the test suite's), "tiny-12" (the same with 12 layers: the test twin of BERT-base),
"tiny-tiles" (hidden 64 in 2 heads of 32: the AMX attention kernel's whole tiles) and "base" (transformers'
config defaults: bert-base-uncased's shape, 12 layers, 110M parameters). Needs torch and transformers (the
``dev`` extra).
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

VOCAB = 96  # the tiny sizes'
BATCH, SEQ = 2, 8
SIZES = ("tiny", "tiny-12", "tiny-tiles", "base")
NUM_LABELS = 3


def tiny_config(config_cls: str, layers: int = 2, hidden: int = 32):
    import transformers

    cls = getattr(transformers, config_cls)
    if config_cls == "DistilBertConfig":
        return cls(vocab_size=VOCAB, dim=hidden, n_layers=layers, n_heads=2, hidden_dim=2 * hidden,
                   max_position_embeddings=64)
    extra = {"embedding_size": 16} if config_cls == "AlbertConfig" else {}
    return cls(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
               intermediate_size=2 * hidden, max_position_embeddings=64, num_labels=NUM_LABELS, **extra)


def config(family: str, size: str = "tiny"):
    """The transformers config of ``family`` at ``size`` (see the module doc)."""
    import transformers

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {SIZES}")
    config_cls = FAMILIES[family][1]
    if size == "base":
        return getattr(transformers, config_cls)(num_labels=NUM_LABELS)
    return tiny_config(config_cls, layers=12 if size == "tiny-12" else 2, hidden=64 if size == "tiny-tiles" else 32)


def without_dropout(model):
    """``model`` with every dropout probability 0 (a compiled step has none unless asked): for references."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def tiny_model(family: str, seed: int = 0, size: str = "tiny"):
    """``family``'s transformers model at ``size`` with seeded weights, every parameter distinct."""
    import torch
    import transformers

    model_cls = FAMILIES[family][0]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config(family, size)).eval()
    with torch.no_grad():  # LayerNorm weights start identical (ones/zeros): make every parameter distinct
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def vocab_size(model) -> int:
    return model.config.vocab_size


def input_names(family: str) -> list[str]:
    return ["input_ids", "attention_mask"] + (["token_type_ids"] if FAMILIES[family][2] else [])


def sample_inputs(family: str, batch: int = BATCH, seq: int = SEQ, seed: int = 0,
                  vocab: int = VOCAB) -> dict[str, np.ndarray]:
    """Token ids in [3, vocab), the last row's second half padded (mask 0), two token types."""
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(3, vocab, size=(batch, seq)).astype(np.int64)}
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[batch - 1, seq // 2:] = 0  # pad the tail of the last row
    feeds["attention_mask"] = mask
    if FAMILIES[family][2]:
        feeds["token_type_ids"] = (np.arange(seq)[None, :] >= seq // 2).astype(np.int64).repeat(batch, 0)
    return feeds


def export(family: str, path: str, *, dynamo: bool, dynamic: bool, opset: int, size: str = "tiny",
           model=None) -> str:
    """Export ``family`` at ``size`` (or the given transformers ``model``) to ``path`` the way a user would;
    returns the path. Weights over 2 GB would need external data: BERT-base is 440 MB, one file."""
    import torch

    model = model if model is not None else tiny_model(family, size=size)
    names = input_names(family)
    feeds = {k: torch.from_numpy(v) for k, v in sample_inputs(family, vocab=vocab_size(model)).items()}
    model.config.return_dict = False  # outputs as a tuple, named below
    with torch.no_grad():
        n_out = len(model(**feeds))
    out_names = [f"output_{i}" for i in range(n_out)]
    kwargs = dict(input_names=names, output_names=out_names, opset_version=opset, dynamo=dynamo)
    if dynamic and dynamo:
        positions = model.config.max_position_embeddings
        batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=2, max=positions)
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
