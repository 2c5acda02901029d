"""Differences between the torch releases the course supports, behind one stable name each.

Lessons, scripts and benchmarks call these instead of the torch API whose name or arguments changed, so no
cell names an argument that some supported torch lacks, and none prints a deprecation warning:

    compat.all_gather_single(out, inp)        all_gather_into_tensor before torch 2.13
    compat.reduce_scatter_single(out, inp)    reduce_scatter_tensor before torch 2.13
    compat.ddp(module, forward_sync_buffers=False, bucket_cap_mb=...)
                                              DDP; its buffer-sync argument was broadcast_buffers before 2.13
    compat.tcp_store(host, port, world_size, master_listen_fd=fd, ...)
                                              TCPStore; its default (libuv) backend takes over a listening
                                              socket only from torch 2.8
    compat.end_group_before_exit()            dist.destroy_process_group(), which can hang with gloo
                                              before torch 2.8
    compat.HAS_ASYNC_SAVE                     whether torch.distributed.checkpoint has async_save
    compat.set_group_timeout(seconds)         a formed group's collective timeout (a private torch call)
    compat.nccl_device_options(device)        init_process_group's device_id= for NCCL, where torch takes it
    compat.full_float32()                     TF32 off for CUDA matmuls and cuDNN: fp32_precision = "ieee" where
                                              torch has it (2.7 on; 2.9 warns on allow_tf32), allow_tf32 before

A feature some supported torch lacks has a name in FEATURES; a cell that shows it starts with
`%%requires NAME` (registered when a notebook imports utils): on a torch without it the cell prints one line
saying so and is skipped, without an error; elsewhere it runs as if the line were not there. One feature is the
machine's, not torch's: `%%requires cluster` (root on Linux with iproute2: utils.tools.cluster's namespace nodes).
"""
import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["all_gather_single", "reduce_scatter_single", "ddp", "tcp_store", "end_group_before_exit", "set_group_timeout",
           "nccl_device_options", "full_float32",
           "CAN_SET_GROUP_TIMEOUT", "GLOO_DESTROY_CAN_HANG", "FEATURES", "requires",
           "TORCH_VERSION", "HAS_ASYNC_SAVE"]

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _has_async_save() -> bool:
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return False
    return hasattr(dcp, "async_save")


def __getattr__(name):
    """`HAS_ASYNC_SAVE`, computed when first asked for: importing torch.distributed.checkpoint costs about a
    second, which every process that imports utils (a torchrun worker too) would otherwise pay."""
    if name == "HAS_ASYNC_SAVE":  # torch.distributed.checkpoint.async_save: saves in the background
        globals()[name] = value = _has_async_save()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


# pytorch/pytorch#150215 (spring 2025) taught the libuv backend, the default since torch 2.4, to serve on a socket
# it is handed; before, it raises NotImplementedError and the legacy backend must be asked for.
_LIBUV_TAKES_LISTEN_FD = TORCH_VERSION >= (2, 8)


def tcp_store(host, port, world_size=None, **kwargs) -> dist.TCPStore:
    """`dist.TCPStore(host, port, world_size, **kwargs)`; one given `master_listen_fd` (a listening socket to
    take over) uses the legacy backend on a torch whose libuv backend cannot take one."""
    if kwargs.get("master_listen_fd") is not None and not _LIBUV_TAKES_LISTEN_FD:
        kwargs.setdefault("use_libuv", False)
    return dist.TCPStore(host, port, world_size, **kwargs)


# pytorch/pytorch#154976 (torch 2.8): before it, a gloo group's destructor joins the group's worker threads
# while holding the GIL, and a worker still letting go of a finished collective's tensors waits for the GIL:
# destroy_process_group() then never returns (seen on torch 2.6 in one launch out of a few).
_GLOO_DESTROY_CAN_HANG = GLOO_DESTROY_CAN_HANG = TORCH_VERSION < (2, 8)


def end_group_before_exit() -> None:
    """End this process's default group just before the process exits (os._exit) without destructors.

    `dist.destroy_process_group()`; where that can hang (a gloo group before torch 2.8), a barrier instead:
    every rank has then finished every collective it started, so none waits on this one when it is gone. A group
    already broken (a timed-out monitored_barrier closes its connections) fails the barrier at once: nothing to
    wait for then.
    """
    if _GLOO_DESTROY_CAN_HANG and dist.get_backend() == "gloo":
        try:
            dist.barrier()
        except RuntimeError:
            pass
    else:
        dist.destroy_process_group()


_SET_PG_TIMEOUT = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
# torch 2.6 has the call, but a gloo group ignores it (a 2 s timeout set late: the all-reduce still waited 6 s for a
# sleeping peer; given to init_process_group: it raised after 2 s). Seen taking effect on 2.13 and 2.14; the
# releases between are untested, so they take the init-time timeout, which works everywhere.
CAN_SET_GROUP_TIMEOUT = _SET_PG_TIMEOUT is not None and TORCH_VERSION >= (2, 13)


def set_group_timeout(seconds: float, group=None) -> None:
    """Make collectives on `group` (default: the default group) fail after `seconds` of waiting for a peer.

    Set after the group formed, so that a short timeout does not also bound the start-up barrier, where ranks may
    arrive seconds apart on a busy machine. torch's own call for it is private; where a torch lacks it
    (CAN_SET_GROUP_TIMEOUT false), pass `timeout=` to init_process_group instead.
    """
    from datetime import timedelta
    _SET_PG_TIMEOUT(timedelta(seconds=seconds), group)


# init_process_group(device_id=) binds a NCCL group to this rank's GPU at once (eager init: NCCL's communicator is
# made with the group, and a rank on the wrong GPU fails there, not at its first collective). torch 2.3 added it; the
# signature is asked anyway, so that a torch without it still starts its groups (lazily).
_INIT_TAKES_DEVICE_ID = "device_id" in inspect.signature(dist.init_process_group).parameters


def nccl_device_options(device) -> dict:
    """Keyword arguments for `dist.init_process_group` that bind a NCCL group to `device` (this rank's GPU):
    `{"device_id": device}`, or `{}` on a torch whose init_process_group does not take it."""
    return {"device_id": device} if _INIT_TAKES_DEVICE_ID else {}


# torch 2.7 added per-backend fp32_precision settings for TF32, and 2.9 warned on every use of the old allow_tf32 flags
# ("Please use the new API settings to control TF32 behavior", pytorch/pytorch#158209; 2.13 and 2.14 do not warn). A
# process that mixes the two APIs gets torch's "mix of the legacy and new APIs" complaints: each torch gets one only.
_HAS_FP32_PRECISION = hasattr(torch.backends.cuda.matmul, "fp32_precision")


def full_float32() -> None:
    """Keep float32 as float32 in this process's CUDA matmuls and cuDNN convolutions (and RNNs): no TF32, whose
    10-bit mantissa Ampere and later GPUs may otherwise round their inputs to. Harmless without a GPU."""
    if _HAS_FP32_PRECISION:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        if hasattr(getattr(torch.backends.cudnn, "rnn", None), "fp32_precision"):
            torch.backends.cudnn.rnn.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


# name: (whether this torch has it, what is missing where it does not), or a function returning that pair
FEATURES = {
    # FSDP2 records an event on its collectives' stream; torch 2.6's CPU streams cannot (torch 2.13's can)
    "fsdp2_on_cpu": (hasattr(getattr(torch, "cpu", None), "Stream") and hasattr(torch.cpu.Stream, "record_event"),
                     "FSDP2 (fully_shard) cannot run on the CPU with this torch: its CPU streams record no events"),
}


def _cluster_feature():
    """Whether this machine can make utils.tools.cluster's namespace nodes (Linux, root, iproute2), and why not."""
    from .tools.cluster import unavailable
    why = unavailable()
    return why is None, why or ""


# features of the machine rather than of torch: a skipped cell says "on this machine". Asked only when a cell
# needs it (a callable in FEATURES): importing utils imports nothing of utils.tools.
_MACHINE_FEATURES = {"cluster"}
FEATURES["cluster"] = _cluster_feature


def requires(line, cell):
    """The `%%requires NAME` cell magic: run the cell if this torch has feature NAME (see FEATURES), else say
    in one line why it is skipped. An error in the cell is an error of the cell, as without the magic."""
    name = line.strip()
    if name not in FEATURES:
        raise ValueError(f"%%requires {name!r}: not a feature utils.compat knows (one of {', '.join(FEATURES)})")
    available, missing = FEATURES[name]() if callable(FEATURES[name]) else FEATURES[name]
    if not available:
        where = "this machine" if name in _MACHINE_FEATURES else f"torch {torch.__version__}"
        print(f"(skipped on {where}: {missing})")
        return None
    from IPython import get_ipython
    result = get_ipython().run_cell(cell, store_history=False)
    result.raise_error()
    return None
