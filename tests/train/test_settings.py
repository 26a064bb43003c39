"""Training settings are checked where they enter (API and CLI alike), the rule in the message: none is taken
silently to train on NaN weights, an all-zero loss or a batch of one."""
import math
import subprocess
import sys

import numpy as np
import pytest

import tvmdm
from tvmdm.core.errors import InputError


@pytest.mark.parametrize("settings, message", [
    ({"lr": math.nan}, r"learning rate must be a finite number >= 0, got nan"),
    ({"lr": -1e-3}, r"learning rate must be a finite number >= 0"),
    ({"betas": (1.5, -2)}, r"betas must be two numbers in \[0, 1\), got \(1.5, -2\)"),
    ({"eps": -1}, r"eps must be a finite number >= 0, got -1"),
    ({"weight_decay": math.inf}, r"weight_decay must be a finite number >= 0"),
])
def test_adamw_refuses_what_torch_refuses(settings, message):
    with pytest.raises(InputError, match=message):
        tvmdm.AdamW(**settings)


@pytest.mark.parametrize("sizes", [{"batch": 0}, {"seq": -3}, {"batch": 2.5}])
def test_zero_or_negative_sizes_are_refused_not_made_one(tiny_layer, sizes):
    with pytest.raises(InputError, match=f"{next(iter(sizes))} must be a whole number >= 1"):
        tvmdm.compile_train_step(tiny_layer, loss="mse", **{"batch": 2, "seq": 8, **sizes})


@pytest.fixture(scope="module")
def classifier_step():
    from tvmdm.train.task import classifier_model

    return tvmdm.compile_train_step(classifier_model(), loss="cross_entropy", batch=2, seq=8, tuning_logs=None)


def _batch(step, labels):
    return dict(tvmdm.random_inputs(step, batch=2, seq=8), labels=np.array(labels, dtype=np.int64))


@pytest.mark.parametrize("labels, bad", [([0, 7], 7), ([-1, 0], -1)])
def test_labels_outside_the_classes_are_refused(classifier_step, labels, bad):
    classes = classifier_step.outputs[0].shape[-1]
    assert bad >= classes or bad < 0
    with pytest.raises(InputError, match=rf"class id {bad}: .* has {classes} classes, so ids must be in \[0, "
                                         rf"{classes}\) or -100"):
        classifier_step.step(_batch(classifier_step, labels))


def test_ignored_labels_and_a_nan_learning_rate_set_later(classifier_step):
    loss = classifier_step.step(_batch(classifier_step, [-100, 1]))  # -100: ignored, as in torch
    assert math.isfinite(loss)
    classifier_step.lr = math.nan
    with pytest.raises(InputError, match="learning rate must be a finite number >= 0, got nan"):
        classifier_step.step(_batch(classifier_step, [0, 1]))
    assert all(np.isfinite(w).all() for w in classifier_step.params().values())  # nothing was updated


@pytest.mark.parametrize("args, message", [
    (["train", "--steps", "-3"], "argument --steps: expected a whole number >= 1, got '-3'"),
    (["analyze", "bert-tiny-layer", "--batch", "0"], "argument --batch: expected a whole number >= 1, got '0'"),
    (["tune", "bert-tiny-layer", "--logs", "x", "--seq", "0"], "argument --seq: expected a whole number >= 1"),
])
def test_cli_refuses_sizes_below_one(args, message):
    done = subprocess.run([sys.executable, "-m", "tvmdm", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-1000:]


def test_progress_times_the_steps_after_the_first(monkeypatch):
    """The first step loads and packs the weights: an ETA averaged with it said 127 s where 8 s were left."""
    import io

    from tvmdm.train import task

    clock = iter([0.0, 4.0, 4.1, 4.2, 4.3])  # start, then the end of each step: 4 s, then 0.1 s a step
    monkeypatch.setattr(task.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    progress = task.StepProgress(11, out)
    for done in range(1, 5):
        progress.update(done, 1.0, 1.0)
    lines = out.getvalue().splitlines()
    assert "first step 4000 ms (loads the weights)" in lines[0]
    assert lines[-1].endswith("100 ms/step  ETA 1s"), lines[-1]  # 7 steps left at 0.1 s
