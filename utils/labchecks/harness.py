"""The shared harness of every lab's checks: run a student's function on ranks, explain what went wrong.

`run_on_ranks` turns every way a distributed function can go wrong into one message a student can act on:
  - not implemented yet (NotImplementedError)        → "replace the stub", and no waiting for a timeout,
  - a built-in collective used where send/recv only   → which call (however it was reached),
  - a crash on some rank                              → the rank and its traceback,
  - a hang                                            → "likely deadlock", with where every rank waits.
The helpers below it word the rest: a wrong answer (rank, element, expected vs got) and a list of problems.
Each lab's own checks live beside this module (lab1.py, …).
"""
from __future__ import annotations

import torch

from ..launching import LaunchError, LaunchTimeout, backend_for, launch

TIMEOUT = 30.0  # seconds for one launch of a check; the cases themselves take well under a second


class LabCheckFailure(AssertionError):
    """A lab check failed. The message says what to fix."""


# ------------------------------------------------------------------ the generic harness

# Why a check's ranks may hang, per lab: the default is lab 1's (point-to-point collectives).
SEND_RECV_DEADLOCK = (
    "Usual causes: every rank calls a blocking dist.send before its "
    "dist.recv (post the send and the receive together as one dist.batch_isend_irecv, like "
    "exchange() does, or let even ranks send first and odd ranks receive first; on NCCL an "
    "isend followed by a recv can hang the same way); "
    "a send without a matching recv (check the peer ranks: every send's receiver must post the "
    "matching receive, from that sender, and both sides must agree on the chunk sizes).")


# On NCCL a rank's Python does not wait in the call that hangs: it queues the call on its GPU and goes on.
NCCL_STACKS = ("On NCCL (these ranks run on GPUs) sends, receives and collectives run on the GPU after Python has "
               "moved on: a rank's stack below shows where it next waited for its GPU (a .cpu() or .item(), for "
               "instance), which may come well after the call that never matched.")


def run_on_ranks(rank_fn, *args, world_size: int, what: str, timeout: float = TIMEOUT, backend: str = "auto",
                 deadlock_hint: str = SEND_RECV_DEADLOCK):
    """`launch(rank_fn, *args)`, turning every failure into a `LabCheckFailure` that says what to do.

    `what` names the student's function in the messages (e.g. "reduce_scatter"). backend "auto" runs on NCCL
    when every rank can have its own GPU, else on gloo. `deadlock_hint` names the usual causes of a hang in
    this lab (default: lab 1's unmatched sends and receives).
    """
    try:
        return launch(rank_fn, *args, world_size=world_size, backend=backend, timeout=timeout)
    except LaunchTimeout as err:
        where = str(err).split("Where each rank is stuck (most recent call last):", 1)[-1].strip()
        on_gpus = (backend_for(world_size) if backend == "auto" else backend) == "nccl"
        raise LabCheckFailure(
            f"✗ {what} at N={world_size}: no result after {timeout:g} s: likely a deadlock (every rank "
            f"is waiting for another). {deadlock_hint}\n" + (NCCL_STACKS + "\n" if on_gpus else "") +
            f"Where each rank was waiting (most recent call last):\n{where}") from None
    except LaunchError as err:
        report = str(err)
        if "NotImplementedError" in report:
            raise LabCheckFailure(
                f"✗ {what} is not implemented yet: it raised NotImplementedError. Replace the "
                "`raise NotImplementedError()` line in its cell with your code, run that cell, then run "
                "this check again.") from None
        if "CollectiveForbiddenError" in report:
            call = report.split("CollectiveForbiddenError: ", 1)[-1].split(" was called", 1)[0]
            raise LabCheckFailure(
                f"✗ {what} called {call}, which the checks forbid: implement it with dist.send, dist.recv, "
                "dist.isend and dist.irecv only (also batched by dist.batch_isend_irecv).") from None
        if "Tensors must be CUDA" in report or "No backend type associated with device type cpu" in report:
            # (the first: NCCL itself; the second: a process group that has NCCL only, torch >= 2.x)
            raise LabCheckFailure(
                f"✗ {what} at N={world_size} handed a CPU tensor to NCCL, which moves GPU tensors only: "
                "create every buffer on the input's device (torch.empty_like(tensor), "
                "torch.empty(..., device=tensor.device), or for a flat bucket torch.zeros(n, device=p.grad.device) "
                "or torch.cat of the gradients).\n" + report) from None
        raise LabCheckFailure(f"✗ {what} failed at N={world_size}:\n{report}") from None


def report(what, world_size, problems, note="", limit=5):
    """Raise a LabCheckFailure listing the first `limit` problems (one line each), after an optional note."""
    if problems:
        more = f"\n  … and {len(problems) - limit} more" if len(problems) > limit else ""
        raise LabCheckFailure(f"✗ {what} at N={world_size}:" + (f"\n  {note}" if note else "") + "\n  "
                              + "\n  ".join(problems[:limit]) + more)


# ------------------------------------------------------------------ inputs and diagnostics

def fmt(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_mismatch(got, expected, offset=0, chunks=None):
    """'element i: expected x, got y' for the first wrong element (index counted from `offset`)."""
    wrong = (got != expected).nonzero().flatten()
    i = wrong[0].item()
    text = (f"{len(wrong)} of {expected.numel()} elements wrong, first at element {offset + i}: "
            f"expected {fmt(expected[i].item())}, got {fmt(got[i].item())}")
    if chunks is not None:
        bad = sorted({c for c, (a, b) in enumerate(chunks) for j in wrong.tolist() if a <= offset + j < b})
        text += f"; wrong chunks: {bad}"
    return text


def compare_result(got, expected, rank, label):
    """[] if `got` is a tensor of the expected dtype and shape, else one line saying how it differs."""
    if not isinstance(got, torch.Tensor):
        return [f"rank {rank}, {label}: returned {type(got).__name__}, expected a tensor"]
    if got.dtype != expected.dtype:
        return [f"rank {rank}, {label}: returned dtype {got.dtype}, expected {expected.dtype} "
                "(keep the input's dtype)"]
    if tuple(got.shape) != tuple(expected.shape):
        return [f"rank {rank}, {label}: returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}"]
    return []


# ------------------------------------------------------------------ what runs on every rank
