"""The tiny layer's PyTorch twin, and how our weights and gradients line up with its parameters."""
import numpy as np


def rel_err(got, want, floor):
    """Max abs error over the reference's largest magnitude (with a floor for all-but-zero gradients, such as
    the key bias's, which softmax's shift invariance makes exactly zero in theory)."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), floor))


def torch_layer(tiny_layer):
    import torch

    from tvmdm.models.torch_reference import TorchReference

    ref = TorchReference("bert-tiny-layer", tiny_layer)
    ref.module.train()
    linear = {f"{n}.weight" for n, m in ref.module.named_modules() if isinstance(m, torch.nn.Linear)}
    # our name and layout of each torch parameter: ONNX keeps Linear weights as [in, out]
    layout = {n: ("layer.0." + n, n in linear) for n, _ in ref.module.named_parameters()}
    return ref, layout


def torch_layer_loss(ref, batch):
    import torch

    out = ref.forward(ref.torch_inputs({k: v for k, v in batch.items() if k != "labels"}))
    out = out[0] if isinstance(out, tuple) else out
    return torch.nn.functional.mse_loss(out, torch.from_numpy(batch["labels"]))


def ours(array, transposed):
    return array.T if transposed else array
