"""Named time spans per rank, on one clock that all processes of this machine share.

    with trace.span("all_reduce", kind="comm"):
        dist.all_reduce(grad)
    return trace.collect()          # from the rank function; plot with utils.plots.plot_timeline

time.perf_counter() is CLOCK_MONOTONIC on Linux: the same clock in every process, so spans from
different ranks line up on one axis.
"""
import time
from contextlib import contextmanager

KINDS = ("compute", "comm", "wait", "data", "other")
_spans: list = []


def now() -> float:
    """Seconds on the machine-wide monotonic clock."""
    return time.perf_counter()


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextmanager
def span(name: str, kind: str = "compute", cuda_sync: bool = False):
    """Record how long the block takes. cuda_sync=True waits for queued GPU work at both ends."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if cuda_sync:
        import torch
        torch.cuda.synchronize()
    start = now()
    try:
        yield
    finally:
        if cuda_sync:
            import torch
            torch.cuda.synchronize()
        record(name, start, now(), kind)


def record(name: str, start: float, end: float, kind: str = "compute") -> None:
    """Add a span measured elsewhere (e.g. inside a communication hook)."""
    _spans.append({"name": name, "kind": kind, "start": start, "end": end, "rank": _rank()})


def collect() -> list:
    """Return this process's spans and start a fresh record."""
    spans = list(_spans)
    _spans.clear()
    return spans
