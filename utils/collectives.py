"""Collectives whose names changed across torch versions, under one stable name.

torch 2.13 renamed `all_gather_into_tensor` → `all_gather_single` and `reduce_scatter_tensor` →
`reduce_scatter_single` (the old names now warn); older releases, such as Colab's, only have the
old names. Lessons call these two functions and never see a warning.
"""
import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op=False):
    """Concatenate every rank's `input` into `output` (world_size × input.numel())."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce `input` across ranks and keep this rank's 1/world_size slice in `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)
