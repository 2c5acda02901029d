"""Which backend and devices a launch uses: NCCL with one CUDA GPU per rank, else gloo on the CPU."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

RANK_MARKER = "COURSE_LAUNCHED_RANK"  # set inside ranks that utils.launch started (utils/rank_process.py)


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_for(world_size: int) -> str:
    """'nccl' when every rank can have its own CUDA GPU, otherwise 'gloo'."""
    return "nccl" if 0 < world_size <= _gpu_count() else "gloo"


def device() -> torch.device:
    """This rank's device: `cuda:<local rank>` under NCCL, else the CPU.

    Outside any rank (the notebook process itself) it is the best single device: cuda:0 or cpu. A rank of
    `launch(..., replace=N)` has no default group (it forms gloo groups of its own, utils/replacement.py): the CPU,
    not cuda:0 for every rank.
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    if os.environ.get(RANK_MARKER):
        return torch.device("cpu")
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank so that all ranks together use each core once."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def describe(world_size: int = 4) -> None:
    """Print which backend and devices a launch of `world_size` ranks will use here."""
    backend = backend_for(world_size)
    gpus = _gpu_count()
    if backend == "nccl":
        where = "one CUDA GPU per rank (" + ("cuda:0" if world_size == 1 else f"cuda:0 … cuda:{world_size - 1}") + ")"
    elif gpus:
        where = (f"CPU ({gpus} GPU(s) found, fewer than {world_size} ranks: NCCL needs one per rank, so every rank "
                 "computes on the CPU, where utils.device() puts its tensors)")
    else:
        where = "CPU (no CUDA GPU found)"
    print(f"{world_size} rank{'s' if world_size != 1 else ''} will use backend '{backend}' on {where}")
