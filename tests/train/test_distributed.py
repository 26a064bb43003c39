"""Data-parallel training: two processes on 127.0.0.1 (torch.distributed, gloo) each on half of every batch reach
the parameters one process reaches on the whole batch, with dropout (each draws its slice of the same masks)."""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import tvmdm
import tvmdm.models
from tests.helpers.tolerance import adam_weight_bound, assert_within, assert_within_rounding, chain_length, rounding_bound

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # two processes and a reference run: ~15 s

STEPS, BATCH, SEQ = 3, 4, 8

WORKER = """
import os, sys, numpy as np, torch.distributed as dist, tvmdm
dist.init_process_group("gloo")
step = tvmdm.compile_train_step(tvmdm.default_model("bert-tiny-layer"), loss="mse",
                                optimizer=tvmdm.AdamW(lr=1e-2), batch={half}, seq={seq}, tuning_logs=None,
                                dropout=0.1, seed=3)
ddp = tvmdm.DataParallel(step)
batches = np.load(sys.argv[1])
losses = [ddp.step(ddp.shard({{k[len(f"{{i}}/"):]: v for k, v in batches.items() if k.startswith(f"{{i}}/")}}))
          for i in range({steps})]
np.savez(sys.argv[2], losses=np.array(losses), **{{k.replace("/", "|"): v for k, v in ddp.params().items()}})
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(step):
    rng = np.random.default_rng(0)
    out = []
    for i in range(STEPS):
        feeds = tvmdm.random_inputs(step, batch=BATCH, seq=SEQ, seed=i)
        out.append(dict(feeds, labels=rng.standard_normal(step.target_spec.shape).astype(np.float32)))
    return out


def test_two_processes_match_one_process_on_the_full_batch(tmp_path, tiny_layer):
    optimizer = tvmdm.AdamW(lr=1e-2)
    single = tvmdm.compile_train_step(tiny_layer, loss="mse", optimizer=optimizer, batch=BATCH, seq=SEQ,
                                      tuning_logs=None, dropout=0.1, seed=3)
    batches = _batches(single)
    np.savez(tmp_path / "batches.npz", **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()})
    expected_losses, grads = [], []  # each step's full-batch gradients, for the bound Adam's update propagates
    for b in batches:
        loss, g = single.gradients(b)  # the step's own dropout masks: gradients() does not advance the step
        grads.append(g)
        expected_losses.append(single.step(b))
        assert loss == expected_losses[-1]

    port = _free_port()
    script = WORKER.format(half=BATCH // 2, seq=SEQ, steps=STEPS)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", TVM_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", script, tmp_path / "batches.npz",
                                       tmp_path / f"rank{rank}.npz"], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]

    # Rounding alone separates the two: the halves' gradients are summed in another order than the full
    # batch's (tests/tolerance.py derives each bound from the reduction lengths).
    config = tvmdm.models.DEFAULT_MODELS["bert-tiny-layer"][1]
    length = chain_length(config.hidden, config.heads, config.ffn, BATCH, SEQ)
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for result in results:
        # the loss of the full batch is the mean of the two halves' losses (equal halves, mean-reduced MSE)
        assert_within_rounding(result["losses"], expected_losses, length, err_msg="losses")
        for name, value in single.params().items():
            steps = [g[name] for g in grads]
            error = [float(rounding_bound(length, np.abs(g).max())) for g in steps]
            bound = adam_weight_bound(steps, error, optimizer.lr, value, optimizer.betas)
            assert_within(result[name.replace("/", "|")], value, bound, err_msg=name)
    for name in single.params():  # and the two processes hold identical weights
        np.testing.assert_array_equal(results[0][name.replace("/", "|")], results[1][name.replace("/", "|")])


def test_data_parallel_needs_an_initialized_group(tiny_layer):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    step = tvmdm.compile_train_step(tiny_layer, loss="mse", batch=2, seq=8, tuning_logs=None)
    with pytest.raises(tvmdm.TvmdmError, match="needs torch.distributed initialized first"):
        tvmdm.DataParallel(step)
