"""PyTorch twins of the embedded models: HF ``transformers`` modules carrying the very weights of our ONNX graphs.

The builder in ``tvmdm.models`` names every initializer as HF names the parameter ("layer.0.attention.self.query
.weight", "encoder.layer.1.output.dense.bias", ...) and stores Linear weights as [in, out] (ONNX MatMul), so the
twin is an HF ``BertLayer`` / ``BertModel`` with those tensors copied in (Linear weights transposed). It is the
PyTorch baseline of the benchmarks and the autograd reference of the training step. Needs torch + transformers
(the ``dev`` extra).
"""
from __future__ import annotations

import numpy as np

from tvmdm import models


def _hf_config(cfg: models.BertConfig):
    import transformers

    return transformers.BertConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        intermediate_size=cfg.ffn, max_position_embeddings=cfg.max_positions, type_vocab_size=cfg.type_vocab,
        layer_norm_eps=cfg.layer_norm_eps, hidden_act="gelu", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager")


def _load_onnx_weights(module, proto, prefix: str) -> None:
    import onnx
    import torch

    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    linear = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    state = {}
    for name, param in module.state_dict().items():
        value = weights.get(prefix + name)
        if value is None:
            raise KeyError(f"the ONNX model has no initializer {prefix + name!r} for the torch parameter {name!r}")
        if name in linear:
            value = value.T  # ONNX MatMul weights are [in, out]; nn.Linear keeps [out, in]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{prefix + name}: ONNX shape {list(value.shape)} != torch shape {list(param.shape)}")
        state[name] = torch.from_numpy(np.array(value))
    module.load_state_dict(state)


def torch_dynamic_quantized(module):
    """``module`` with every nn.Linear on int8 weights and dynamically quantized activations (PyTorch's
    dynamic quantization, what its users run for int8 BERT on CPUs)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notes (it moves to torchao)
        return torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)


class TorchReference:
    """``run(feeds) -> [outputs]`` with the same input names, dtypes and output order as the ONNX model."""

    def __init__(self, name: str, proto=None, device: str = "cpu", precision: str = "fp32"):
        """precision: "fp32" (strict: no TF32 on CUDA), "tf32" (CUDA matmuls in TF32), "fp16" or "bf16"
        (torch.autocast, PyTorch's mixed precision), "int8" (CPU: PyTorch's dynamic quantization)."""
        import torch
        import transformers

        if precision not in ("fp32", "tf32", "fp16", "bf16", "int8"):
            raise ValueError(f"precision must be fp32, tf32, fp16, bf16 or int8, got {precision!r}")
        if precision == "int8" and device != "cpu":
            raise ValueError("precision='int8' (PyTorch's dynamic quantization) runs on the CPU only")
        self.precision = precision

        if name not in models.DEFAULT_MODELS:
            raise KeyError(f"no PyTorch twin for {name!r}: only the embedded models {sorted(models.DEFAULT_MODELS)}")
        cfg = models.DEFAULT_MODELS[name][1]
        proto = proto if proto is not None else models.default_model(name)
        self.name = name
        self.is_layer = not models.is_whole_model(name)
        self.device = torch.device(device)
        if self.is_layer:
            module = transformers.models.bert.modeling_bert.BertLayer(_hf_config(cfg))
            _load_onnx_weights(module, proto, "layer.0.")
        else:
            module = transformers.BertModel(_hf_config(cfg), add_pooling_layer=False)
            _load_onnx_weights(module, proto, "")
        self.module = module.to(self.device).eval()
        if precision == "int8":  # int8 weights, activations quantized per call (tvmdm.bench.quantized)
            self.module = torch_dynamic_quantized(self.module)
        self._forward = self.module

    def compile(self) -> "TorchReference":
        """Use ``torch.compile`` (inductor) for later calls; the first call pays the compile."""
        import torch

        self._forward = torch.compile(self.module)
        return self

    def torch_inputs(self, feeds: dict[str, np.ndarray]) -> dict:
        import torch

        return {k: torch.from_numpy(np.asarray(v)).to(self.device) for k, v in feeds.items()}

    def forward(self, inputs: dict):
        """Torch tensors in, the output tensor out (differentiable when grad is enabled)."""
        if self.is_layer:
            mask = inputs["attention_mask"][:, None, None, :].to(inputs["hidden_states"].dtype)
            additive = (1.0 - mask) * float(np.finfo(np.float32).min)  # as HF extends a 0/1 padding mask
            return self._forward(inputs["hidden_states"], attention_mask=additive)
        return self._forward(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                             token_type_ids=inputs["token_type_ids"]).last_hidden_state

    def _precision(self):
        """The context the forward pass runs in for self.precision."""
        import contextlib

        import torch

        if self.precision in ("fp16", "bf16"):
            return torch.autocast(self.device.type, dtype=getattr(torch, {"fp16": "float16",
                                                                          "bf16": "bfloat16"}[self.precision]))
        stack = contextlib.ExitStack()
        if self.device.type == "cuda":
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"
            stack.callback(setattr, torch.backends.cuda.matmul, "allow_tf32", previous)
        return stack

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        with torch.inference_mode(), self._precision():
            out = self.forward(self.torch_inputs(feeds))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return [out.detach().float().cpu().numpy()]


def torch_step(ref, feeds: dict, target: np.ndarray, lr: float, autocast: str | None = None):
    """A PyTorch training step on ``ref``'s module (an HF twin of the ONNX model): returns step() -> loss.
    ``autocast``: "bf16" or "fp16": forward and loss under torch.autocast (PyTorch's mixed precision; fp16 with
    a GradScaler, as AMP is used on CUDA)."""
    import torch

    ref.module.train()
    optimizer = torch.optim.AdamW(ref.module.parameters(), lr=lr)
    inputs, target_t = ref.torch_inputs(feeds), torch.from_numpy(target).to(ref.device)

    def loss_of_forward():
        out = ref.forward(inputs)
        return torch.nn.functional.mse_loss((out[0] if isinstance(out, tuple) else out).float(), target_t)

    return _optimizer_step(loss_of_forward, optimizer, ref.device.type, autocast)


def hf_classifier_step(model, feeds: dict, labels: np.ndarray, lr: float, autocast: str | None = None,
                       compile: bool = False):
    """A PyTorch training step on a transformers sequence classifier (its own cross-entropy on ``labels``),
    AdamW(lr, weight decay 0.01: tvmdm.AdamW's default): returns step() -> loss. ``autocast`` as torch_step's;
    ``compile``: the model through torch.compile first."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    forward = torch.compile(model) if compile else model
    inputs = {k: torch.from_numpy(v) for k, v in feeds.items()}
    labels_t = torch.from_numpy(labels)
    return _optimizer_step(lambda: forward(**inputs, labels=labels_t).loss, optimizer, "cpu", autocast)


def _optimizer_step(loss_of_forward, optimizer, device_type: str, autocast: str | None):
    """step() -> loss: zero the gradients, ``loss_of_forward()`` under ``autocast`` ("bf16", "fp16" with a
    GradScaler, or None), backward, the optimizer's step."""
    import contextlib

    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast)
    context = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device_type) if autocast == "fp16" else None

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with context():
            loss = loss_of_forward()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.item()  # a host read: the step has finished, as tvmdm's returns its loss

    return step
