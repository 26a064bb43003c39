"""Inputs as users hold them (a tokenizer's BatchEncoding of numpy arrays, torch tensors or lists; any DLPack
exporter), onnxruntime's ``run(None, feeds)`` form, and outputs as DLPack: every form gives onnxruntime's answer."""
import numpy as np
import pytest

import tvmdm
from tvmdm.runtime.feeds import device_tensor

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "data", "movement", "is", "all", "you", "need", "bert"]


@pytest.fixture(scope="module")
def model_and_compiled():
    model = tvmdm.default_model("bert-small")
    return model, tvmdm.compile(model)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    vocab = tmp_path_factory.mktemp("tok") / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    return transformers.BertTokenizerFast(vocab_file=str(vocab))


def _reference(model, feeds):
    from tvmdm.build.check import ort_session

    return ort_session(model).run(None, {k: np.asarray(v) for k, v in feeds.items()})


TEXTS = ["data movement is all you need", "bert"]


@pytest.mark.parametrize("tensors", ["np", "pt", None], ids=["numpy", "torch", "lists"])
def test_a_tokenizers_output_runs_as_it_comes(model_and_compiled, tokenizer, tensors):
    if tensors == "pt":
        pytest.importorskip("torch")
    model, compiled = model_and_compiled
    encoding = tokenizer(TEXTS, padding=True, return_tensors=tensors)
    expected = _reference(model, {k: np.asarray(v) for k, v in encoding.items()})
    for got in (compiled.run(encoding), compiled.run(None, encoding)):
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-4, atol=1e-4)


def test_torch_tensors_that_require_grad_and_outputs_as_dlpack(model_and_compiled):
    torch = pytest.importorskip("torch")
    model, compiled = model_and_compiled
    feeds = tvmdm.random_inputs(compiled, batch=2, seq=8)
    as_torch = {k: torch.from_numpy(v) for k, v in feeds.items()}
    out = compiled.run(None, as_torch, dlpack=True)[0]
    tensor = torch.from_dlpack(out)
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (2, 8, 256)
    np.testing.assert_allclose(tensor.numpy(), _reference(model, feeds)[0], rtol=1e-4, atol=1e-4)
    floats = tvmdm.compile(tvmdm.default_model("bert-tiny-layer"))
    layer_feeds = tvmdm.random_inputs(floats, batch=1, seq=4)
    hidden = torch.from_numpy(layer_feeds["hidden_states"]).requires_grad_()
    got = floats.run({**layer_feeds, "hidden_states": hidden})[0]
    np.testing.assert_array_equal(got, floats.run(layer_feeds)[0])


class _Exporter:
    """A minimal DLPack producer (no numpy, no torch type): what any array library hands over."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_any_dlpack_exporter_and_output_selection(model_and_compiled):
    model, compiled = model_and_compiled
    feeds = tvmdm.random_inputs(compiled, batch=2, seq=8)
    expected = _reference(model, feeds)
    got = compiled.run(compiled.output_names[::-1], {k: _Exporter(v) for k, v in feeds.items()})
    for value, want in zip(got, expected[::-1]):
        np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(tvmdm.InputError, match=r"unknown outputs \['logits'\]; the model's outputs are"):
        compiled.run(["logits"], feeds)
    with pytest.raises(tvmdm.InputError, match=r"input 'input_ids' must be a numpy array, a torch tensor, a DLPack "
                                               r"exporter or a list, got str"):
        compiled.run({**feeds, "input_ids": "data movement"})
    with pytest.raises(tvmdm.InputError, match="inputs must be a mapping of input name -> array"):
        compiled.run([feeds["input_ids"]])


def test_aligned_inputs_are_shared_not_copied():
    import tvm

    aligned = np.zeros(1024 + 16, np.float32)
    start = (-aligned.ctypes.data % 64) // 4
    array = aligned[start:start + 1024]
    assert np.shares_memory(np.from_dlpack(device_tensor(array, tvm.cpu(0))), array)
    unaligned = aligned[start + 1:start + 1 + 1000]  # 4 bytes past a 64-byte boundary: TVM's kernels assume one
    copied = device_tensor(unaligned, tvm.cpu(0))
    assert not np.shares_memory(np.from_dlpack(copied), aligned)
    np.testing.assert_array_equal(copied.numpy(), unaligned)


def test_a_training_batch_of_torch_tensors(tiny_layer):
    torch = pytest.importorskip("torch")
    step = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=4)
    feeds = tvmdm.random_inputs(step, batch=2, seq=4)
    target = np.random.default_rng(0).standard_normal((2, 4, 32)).astype(np.float32)
    as_numpy = step.gradients({**feeds, "target": target})
    as_torch = step.gradients({**{k: torch.from_numpy(v) for k, v in feeds.items()}, "target": torch.from_numpy(target)})
    assert as_numpy[0] == as_torch[0]
    for name, grad in as_numpy[1].items():
        np.testing.assert_array_equal(grad, as_torch[1][name])
