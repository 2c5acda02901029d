"""Differences between the torch releases the course supports, behind one stable name each.

Lessons, scripts and benchmarks call these instead of the torch API whose name or arguments changed, so no
cell names an argument that some supported torch lacks, and none prints a deprecation warning:

    compat.all_gather_single(out, inp)        all_gather_into_tensor before torch 2.13
    compat.reduce_scatter_single(out, inp)    reduce_scatter_tensor before torch 2.13
    compat.ddp(module, forward_sync_buffers=False, bucket_cap_mb=...)
                                              DDP; its buffer-sync argument was broadcast_buffers before 2.13
    compat.HAS_ASYNC_SAVE                     whether torch.distributed.checkpoint has async_save
"""
import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["all_gather_single", "reduce_scatter_single", "ddp", "TORCH_VERSION", "HAS_ASYNC_SAVE"]

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _has_async_save() -> bool:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return False
    return hasattr(dcp, "async_save")


HAS_ASYNC_SAVE = _has_async_save()  # torch.distributed.checkpoint.async_save: saves in the background


def all_gather_single(output, input, group=None, async_op=False):
    """Concatenate every rank's `input` into `output` (world_size × input.numel())."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce `input` across ranks and keep this rank's 1/world_size slice in `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)


_DDP_TAKES_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def ddp(module, *, forward_sync_buffers: bool = True, **kwargs) -> DistributedDataParallel:
    """`DistributedDataParallel(module, **kwargs)`; buffers are broadcast from rank 0 when it is built, and in
    every forward too only if `forward_sync_buffers`.

    torch 2.13 named this `forward_sync_buffers` (and deprecated `broadcast_buffers`, which warns). Before
    2.13, `broadcast_buffers=False` also skipped the broadcast at construction: here the buffers are then
    broadcast once by hand, so both behave as 2.13 does.
    """
    if _DDP_TAKES_FORWARD_SYNC:
        return DistributedDataParallel(module, forward_sync_buffers=forward_sync_buffers, **kwargs)
    if not forward_sync_buffers:
        group = kwargs.get("process_group")
        for buffer in module.buffers():
            dist.broadcast(buffer, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return DistributedDataParallel(module, broadcast_buffers=forward_sync_buffers, **kwargs)
