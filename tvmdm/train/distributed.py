"""Data-parallel training of a compiled step on torch.distributed (gloo on CPU, NCCL on GPU).

Each process compiles the same step, takes its shard of every batch and runs

    loss, grads = step.device_gradients(shard)      compiled forward + backward
    all_reduce(grads) / world_size                  torch.distributed, on the very TVM buffers
    step.apply_gradients(grads)                     compiled AdamW update

The gradients cross into torch by DLPack: torch tensors that view TVM's buffers, so the all-reduce writes the
averaged values in place, without a copy. With equal shards and a mean-reduced loss (MSE; cross-entropy
without ignored labels), the average of the shard gradients is the full-batch gradient: every process ends
with the parameters one process would reach on the whole batch, dropout included (each process draws its
slice of the full batch's masks).

    torchrun --nproc-per-node 2 train.py      # or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    dist.init_process_group("gloo")
    ddp = tvmdm.DataParallel(tvmdm.compile_train_step(model, batch=per_process_batch, seq=128))
    for batch in data: loss = ddp.step(ddp.shard(batch))
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tvmdm.core.errors import InputError, TvmdmError


class DataParallel:
    """A TrainStep whose gradients are averaged over a torch.distributed process group at every step."""

    def __init__(self, step, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise TvmdmError("DataParallel needs torch.distributed initialized first "
                             "(dist.init_process_group('gloo') on CPU, 'nccl' on GPU)")
        self.step_fn, self.group, self.dist = step, group, dist
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # each process draws its slice of the full batch's dropout masks (tvmdm.train.dropout)
        step.dropout = dataclasses.replace(step.dropout, world=self.world_size, rank=self.rank)
        self._broadcast_weights()

    def _broadcast_weights(self) -> None:
        """Start every process from rank 0's weights (the same file gives the same weights; this makes sure)."""
        import torch

        self.step_fn._ensure_loaded()
        for tensor in self.step_fn._params:
            self.dist.broadcast(torch.from_dlpack(tensor), src=0, group=self.group)

    def shard(self, batch: dict) -> dict:
        """This process's equal slice (along axis 0) of a full batch, every array (and the labels) alike."""
        sizes = {k: len(v) for k, v in batch.items()}
        full = next(iter(sizes.values()))
        if len(set(sizes.values())) != 1 or full % self.world_size:
            raise InputError(f"a full batch must split evenly over {self.world_size} processes along axis 0; "
                             f"got sizes {sizes}")
        per = full // self.world_size
        return {k: np.ascontiguousarray(v[self.rank * per:(self.rank + 1) * per]) for k, v in batch.items()}

    def step(self, shard: dict) -> float:
        """One data-parallel step on this process's ``shard``; returns the loss averaged over the processes."""
        import torch

        loss, grads = self.step_fn.device_gradients(shard)
        views = [torch.from_dlpack(g) for g in grads]  # no copies: torch writes TVM's buffers
        for view in views:
            self.dist.all_reduce(view, group=self.group)
            view.div_(self.world_size)
        self.step_fn.apply_gradients(grads)
        total = torch.tensor([float(loss.numpy())], dtype=torch.float64)
        self.dist.all_reduce(total, group=self.group)
        return float(total.item()) / self.world_size

    def __getattr__(self, name):  # params(), state_dict(), export(), run() ... of the wrapped step
        if name == "step_fn":
            raise AttributeError(name)
        return getattr(self.step_fn, name)
