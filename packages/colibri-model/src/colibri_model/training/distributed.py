"""torch.distributed plumbing: one process per device under `torchrun`, or a plain process.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); with a world of
one it initialises nothing, so the same trainer code runs unchanged in a notebook. NCCL on
CUDA, gloo on CPU (how the multi-process path is tested on machines without GPUs).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialised_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(tensor)
        return tensor

    def shared_uuid(self) -> str:
        """A uuid4 hex that every rank agrees on (rank 0's, broadcast). Every rank must call it.

        NOTE: from os.urandom, never torch's generator, so saving a checkpoint does not change
        the RNG state that training_state.json records.
        """
        value = uuid.uuid4().bytes
        if self.enabled:
            buffer = torch.tensor(list(value), dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, src=0)
            value = bytes(buffer.cpu().tolist())
        return value.hex()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.initialised_here and dist.is_initialized():
            dist.destroy_process_group()
            self.initialised_here = False


def pick_device(preference: str, local_rank: int = 0) -> torch.device:
    if preference == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(preference)
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def init_distributed(device_preference: str = "auto") -> DistributedContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistributedContext(rank=rank, world_size=world, local_rank=local, device=device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        ctx.initialised_here = True
    return ctx
