"""The compiled training step against PyTorch autograd and torch.optim.AdamW, on the same weights."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tvmdm
from tvmdm.train import task as train_task
from tvmdm.core.errors import ArtifactError, InputError
from tests.helpers.torch_layer import ours as _ours, rel_err as _rel_err, torch_layer as _torch_layer, torch_layer_loss as _torch_layer_loss

torch = pytest.importorskip("torch")

LR = 1e-2


@pytest.fixture(scope="module")
def layer_step(tiny_layer):
    return tvmdm.compile_train_step(tiny_layer, loss="mse", optimizer=tvmdm.AdamW(lr=LR), batch=2, seq=8,
                                    tuning_logs=None)


@pytest.fixture(scope="module")
def layer_batch(layer_step):
    feeds = tvmdm.random_inputs(layer_step, batch=2, seq=8)
    labels = np.random.default_rng(1).standard_normal(layer_step.target_spec.shape).astype(np.float32)
    return dict(feeds, labels=labels)


def test_layer_loss_and_every_gradient_match_torch_autograd(tiny_layer, layer_step, layer_batch):
    ref, layout = _torch_layer(tiny_layer)
    loss, grads = layer_step.gradients(layer_batch)
    torch_loss = _torch_layer_loss(ref, layer_batch)
    torch_loss.backward()
    assert loss == pytest.approx(torch_loss.item(), rel=1e-5)
    assert len(grads) == len(layout) == 16
    scale = max(p.grad.abs().max().item() for p in ref.module.parameters())
    for name, p in ref.module.named_parameters():
        ours, transposed = layout[name]
        assert _rel_err(_ours(grads[ours], transposed), p.grad.numpy(), 1e-3 * scale) < 1e-5, name


def test_three_adamw_steps_match_torch_optim(tiny_layer, layer_step, layer_batch):
    ref, layout = _torch_layer(tiny_layer)
    start = layer_step.state_dict()
    optimizer = torch.optim.AdamW(ref.module.parameters(), lr=LR)  # torch's defaults = tvmdm.AdamW's
    try:
        for _ in range(3):
            ours = layer_step.step(layer_batch)
            optimizer.zero_grad()
            theirs = _torch_layer_loss(ref, layer_batch)
            theirs.backward()
            optimizer.step()
            assert ours == pytest.approx(theirs.item(), rel=1e-5)
        params = layer_step.params()
        for name, p in ref.module.named_parameters():
            ours, transposed = layout[name]
            got, want = _ours(params[ours], transposed), p.detach().numpy()
            if name == "attention.self.key.bias":
                # Its gradient is zero in exact arithmetic (softmax is shift-invariant), so Adam, normalizing
                # rounding noise, moves it by up to lr a step in both frameworks: only that bound holds.
                start_value = _ours(start[f"weights/{ours}"], transposed)
                assert np.abs(got - start_value).max() <= 3 * LR * 1.01
                continue
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        assert layer_step.step_count == 3
    finally:
        layer_step.load_state_dict(start)


@pytest.mark.slow
def test_hf_sequence_classifier_gradients_match_torch_autograd(hf_export):
    from tvmdm.models import hf_export as hf_exports

    step = tvmdm.compile_train_step(hf_export("bert-seqcls", dynamic=True), loss="cross_entropy", batch=2, seq=8,
                                    tuning_logs=None)
    feeds = hf_exports.sample_inputs("bert-seqcls")
    labels = np.array([0, 2], dtype=np.int64)
    loss, grads = step.gradients(dict(feeds, labels=labels))
    model = hf_exports.tiny_model("bert-seqcls").train()
    for m in model.modules():  # dropout off: the compiled step has none unless asked
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, labels=torch.from_numpy(labels))
    out.loss.backward()
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    # The exporter renames initializers (Linear weights become onnx::MatMul_N, transposed): match by value.
    weights = step.params()
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    matched = set()
    for name, p in model.named_parameters():
        value = p.detach().numpy()
        hits = [(k, False) for k, w in weights.items() if w.shape == value.shape and np.array_equal(w, value)]
        hits += [(k, True) for k, w in weights.items() if w.ndim == 2 and w.shape == value.T.shape
                 and np.array_equal(w, value.T)]
        assert len(hits) == 1, f"{name}: {len(hits)} initializers carry its value"
        ours, transposed = hits[0]
        matched.add(ours)
        assert _rel_err(_ours(grads[ours], transposed), p.grad.numpy(), 1e-3 * scale) < 1e-5, name
    assert matched == set(weights)  # every trained tensor is a torch parameter


@pytest.mark.slow
def test_fifty_steps_lower_the_loss_on_the_synthetic_task(tmp_path):
    losses = train_task.run_train(steps=50, batch=8, seq=16, lr=1e-3, plot=str(tmp_path / "loss.png"),
                                  json_path=str(tmp_path / "losses.json"))
    assert len(losses) == 50 and np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "losses.json").read_text())["losses"] == losses


LOAD_AND_STEP = """
import sys, numpy as np, tvmdm
assert "onnx" not in sys.modules
step = tvmdm.load_train_step(sys.argv[1])
batch = dict(np.load(sys.argv[2]))
loss = step.step(batch)
assert "onnx" not in sys.modules, "loading a training step must not need onnx"
np.savez(sys.argv[3], loss=loss, **{"state|" + k.replace("/", "|"): v for k, v in step.state_dict().items()})
"""


@pytest.mark.slow
def test_export_and_load_resume_training_in_a_fresh_process(layer_step, layer_batch, tmp_path):
    start = layer_step.state_dict()
    try:
        layer_step.step(layer_batch)
        path = layer_step.export(tmp_path / "step.tar")
        np.savez(tmp_path / "batch.npz", **layer_batch)
        expected_loss = layer_step.step(layer_batch)
        expected = layer_step.state_dict()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        subprocess.run([sys.executable, "-c", LOAD_AND_STEP, path, tmp_path / "batch.npz", tmp_path / "out.npz"],
                       check=True, env=env, cwd=tmp_path)
        out = np.load(tmp_path / "out.npz")
        assert float(out["loss"]) == pytest.approx(expected_loss, rel=1e-6)
        assert int(out["state|step"]) == 2
        for key, value in expected.items():
            np.testing.assert_allclose(out["state|" + key.replace("/", "|")], value, rtol=1e-6, atol=1e-7, err_msg=key)
    finally:
        layer_step.load_state_dict(start)


def test_state_dict_round_trip(layer_step, layer_batch):
    start = layer_step.state_dict()
    assert int(start["step"]) == 0 and all(not v.any() for k, v in start.items() if k.startswith("adam_"))
    first = layer_step.step(layer_batch)
    layer_step.load_state_dict(start)
    assert layer_step.step(layer_batch) == first  # same state, same batch: the same loss, bit for bit
    layer_step.load_state_dict(start)


def test_bad_batches_and_states_are_named(layer_step, layer_batch):
    with pytest.raises(InputError, match="exactly one of \\['labels', 'target'\\]"):
        layer_step.step({k: v for k, v in layer_batch.items() if k != "labels"})
    with pytest.raises(InputError, match=r"batch\['labels'\] must be float32 \[2, 8, 32\]"):
        layer_step.step(dict(layer_batch, labels=layer_batch["labels"].astype(np.float64)))
    with pytest.raises(InputError, match="input 'attention_mask' axis 1 has size 4"):
        layer_step.step(dict(layer_batch, attention_mask=np.ones((2, 4), np.int64)))
    state = layer_step.state_dict()
    with pytest.raises(InputError, match="missing \\['adam_m/layer.0"):
        layer_step.load_state_dict({k: v for k, v in state.items() if not k.startswith("adam_m/")})
    name = "weights/layer.0.output.dense.bias"
    with pytest.raises(InputError, match=f"state\\['{name}'\\] is float32 \\[3\\]"):
        layer_step.load_state_dict(dict(state, **{name: np.zeros(3, np.float32)}))


def test_training_needs_static_shapes_and_a_train_step_file(tiny_layer, tiny_compiled, tmp_path):
    with pytest.raises(InputError, match="training needs static shapes, but input 'hidden_states' has shape "
                                         "\\[batch, seq, 32\\]: pass batch= and seq="):
        tvmdm.compile_train_step(tiny_layer)
    inference = tiny_compiled.export(tmp_path / "inference.tvmdm")
    with pytest.raises(ArtifactError, match="expected tvmdm-train-step v1"):
        tvmdm.load_train_step(inference)


@pytest.mark.slow
def test_cli_train_runs_with_progress_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tvmdm", "train", "--steps", "3", "--batch", "2", "--seq", "8",
                          "--plot", str(tmp_path / "loss.png"), "--export", str(tmp_path / "step.tar")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "3/3 steps" in out.stderr and "ms/step" in out.stderr
    assert (tmp_path / "loss.png").exists()
    assert tvmdm.load_train_step(tmp_path / "step.tar").step_count == 3


@pytest.fixture(scope="module")
def small_classifier():
    return train_task.classifier_model()


@pytest.mark.slow
def test_checkpointing_changes_no_number_and_cuts_live_memory(small_classifier):
    from tvmdm.train.checkpoint import find_regions
    from onnx_import import import_onnx

    steps = {mode: tvmdm.compile_train_step(small_classifier, batch=8, seq=64, checkpoint=mode, tuning_logs=None)
             for mode in (False, "attention", "layer")}
    batch = train_task.synthetic_batch(steps[False], np.random.default_rng(0))
    base_loss, base_grads = steps[False].gradients(batch)
    base_steps = [steps[False].step(batch) for _ in range(2)]  # the second loss is after one update
    for mode in ("attention", "layer"):
        loss, grads = steps[mode].gradients(batch)
        assert loss == pytest.approx(base_loss, rel=1e-6)
        for name, g in base_grads.items():
            np.testing.assert_allclose(grads[name], g, rtol=1e-5, atol=1e-7, err_msg=f"{mode}: {name}")
        assert [steps[mode].step(batch) for _ in range(2)] == pytest.approx(base_steps, rel=1e-5)
    peak = {mode: s.memory["peak_live"] for mode, s in steps.items()}
    assert peak["layer"] < peak["attention"] < peak[False]
    assert all(s.memory["planned"] > 0 for s in steps.values())
    # two encoder layers: two regions each, the attention ones inside the layer ones
    main = import_onnx(small_classifier, shapes={n: [8, 64] for n in ("input_ids", "attention_mask",
                                                                     "token_type_ids")}).mod["main"]
    attention, layer = find_regions(main, "attention"), find_regions(main, "layer")
    assert len(attention) == len(layer) == 2
    assert all(a[0] == l[0] and a[1] < l[1] for a, l in zip(attention, layer))


def test_unknown_checkpoint_mode_is_named(tiny_layer):
    with pytest.raises(ValueError, match="unknown checkpoint mode 'everything'"):
        tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, checkpoint="everything")


def _torch_layer_with_masks(module, x, attention_mask, masks):
    """HF BertLayer's forward written out, with dropout as explicit keep-masks where HF applies it."""
    sa = module.attention.self
    b, s, hidden = x.shape
    heads = sa.num_attention_heads
    d = hidden // heads

    def split(t):
        return t.view(b, s, heads, d).transpose(1, 2)

    q, k, v = split(sa.query(x)), split(sa.key(x)), split(sa.value(x))
    additive = (1.0 - attention_mask[:, None, None, :].float()) * float(np.finfo(np.float32).min)
    probs = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5 + additive, dim=-1) * masks[0]
    context = (probs @ v).transpose(1, 2).reshape(b, s, hidden)
    attn = module.attention.output.LayerNorm(module.attention.output.dense(context) * masks[1] + x)
    inner = torch.nn.functional.gelu(module.intermediate.dense(attn))
    return module.output.LayerNorm(module.output.dense(inner) * masks[2] + attn)


@pytest.mark.slow
def test_dropout_masks_sit_where_hf_applies_dropout_and_match_torch(tiny_layer, layer_batch):
    ref, layout = _torch_layer(tiny_layer)
    step = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, dropout=0.25, seed=7, tuning_logs=None)
    assert [s.name for s in step.dropout.sites] == ["attention_probs.0", "hidden.0", "hidden.1"]
    masks = step.dropout.masks(1)
    assert all(set(np.unique(m)) <= {0.0, np.float32(1 / 0.75)} for m in masks)
    assert 0.6 < np.mean(masks[0] > 0) < 0.9  # about 3/4 kept
    loss, grads = step.gradients(layer_batch)
    inputs = ref.torch_inputs({k: v for k, v in layer_batch.items() if k != "labels"})
    out = _torch_layer_with_masks(ref.module, inputs["hidden_states"], inputs["attention_mask"],
                                  [torch.from_numpy(m) for m in masks])
    theirs = torch.nn.functional.mse_loss(out, torch.from_numpy(layer_batch["labels"]))
    theirs.backward()
    assert loss == pytest.approx(theirs.item(), rel=1e-5)
    scale = max(p.grad.abs().max().item() for p in ref.module.parameters())
    for name, p in ref.module.named_parameters():
        ours, transposed = layout[name]
        assert _rel_err(_ours(grads[ours], transposed), p.grad.numpy(), 1e-3 * scale) < 1e-5, name
    # inference (run) has no dropout: the plain model, as HF's in eval mode
    feeds = {k: v for k, v in layer_batch.items() if k != "labels"}
    np.testing.assert_allclose(step.run(feeds)[0], ref.run(feeds)[0], rtol=1e-5, atol=1e-5)
    # masks change every step and depend on the seed alone: the same seed replays the same losses
    assert not np.array_equal(step.dropout.masks(2)[0], masks[0])
    again = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, dropout=0.25, seed=7, tuning_logs=None)
    other = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, dropout=0.25, seed=8, tuning_logs=None)
    runs = [[s.step(layer_batch) for _ in range(3)] for s in (step, again, other)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.slow
def test_hf_masked_lm_with_tied_decoder_matches_torch(hf_export):
    """MaskedLM ties its decoder to the word embeddings; torch's exporter writes the decoder as a transposed copy.
    The step trains them as one tensor, as torch does: the loss (with -100 labels ignored) and gradients match."""
    from tvmdm.models import hf_export as hf_exports

    step = tvmdm.compile_train_step(hf_export("bert-mlm", dynamic=True), loss="cross_entropy", batch=2, seq=8,
                                    tuning_logs=None)
    model = hf_exports.tiny_model("bert-mlm").train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    word = model.bert.embeddings.word_embeddings.weight.detach().numpy()
    copies = [n for n, w in step.params().items() if w.shape == word.T.shape and np.array_equal(w, word.T)]
    assert copies == []  # the transposed copy is gone: one tensor
    feeds = hf_exports.sample_inputs("bert-mlm")
    labels = np.full((2, 8), -100, np.int64)
    labels[0, 1], labels[0, 5], labels[1, 2] = 7, 42, 90  # three masked positions; the rest ignored
    loss, grads = step.gradients(dict(feeds, labels=labels))
    out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, labels=torch.from_numpy(labels))
    out.loss.backward()
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    weights = step.params()
    scale = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        value = p.detach().numpy()
        hits = [k for k, w in weights.items() if w.shape == value.shape and np.array_equal(w, value)]
        hits += [k for k, w in weights.items() if w.ndim == 2 and w.shape == value.T.shape and
                 np.array_equal(w, value.T)]
        assert len(hits) == 1, f"{name}: {hits}"
        got = grads[hits[0]] if np.array_equal(weights[hits[0]], value) else grads[hits[0]].T
        assert _rel_err(got, p.grad.numpy(), 1e-3 * scale) < 1e-5, name


def test_training_step_builds_for_cuda_without_a_gpu(tiny_layer):
    """dlight schedules every forward and backward kernel (a rule that crashes on one is skipped for it)."""
    step = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, target="cuda:sm_80", tuning_logs=None)
    from schedules.rule import kernels
    from tests.helpers.cuda import cuda_source as _cuda_source

    assert step.target_kind == "cuda"
    source = _cuda_source(step)

    assert source.count("__global__") >= len(kernels(step.mod)) > 40
    assert "threadIdx.x" in source


def test_data_parallel_masks_are_slices_of_the_full_batch_masks():
    from tvmdm.core.training import DropoutSite, masks_for_step

    full_sites = [DropoutSite("attention_probs.0", (4, 2, 8, 8), "float32"), DropoutSite("hidden.0", (4, 8, 32),
                                                                                          "float32")]
    half_sites = [DropoutSite(s.name, (2, *s.shape[1:]), s.dtype) for s in full_sites]
    full = masks_for_step(full_sites, 0.3, seed=5, step=2)
    halves = [masks_for_step(half_sites, 0.3, seed=5, step=2, world=2, rank=r) for r in range(2)]
    for i in range(len(full_sites)):
        np.testing.assert_array_equal(np.concatenate([halves[0][i], halves[1][i]]), full[i])
    assert not np.array_equal(full[0], masks_for_step(full_sites, 0.3, seed=5, step=3)[0])
