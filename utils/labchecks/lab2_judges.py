"""Lab 2's judges: pure functions of (case, world size, the ranks' plain data, the reference) that return a list
of problems, each a line a student can act on (empty: passed). lab2.py re-exports them; a grader calls them in a
process that runs no student code.
"""
from __future__ import annotations

import torch

from . import handles
from .harness import fmt
from .lab2_cases import ATOL, EARLY_SHARE, MiB, RTOL, build_model, gradient_bytes, label, micro_batches

def close(got, want):
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL)


def _first_difference(got, want):
    diff = (got.double() - want.double()).abs()
    i = int(diff.flatten().argmax())
    return (f"max |diff| {diff.max().item():.3g} at element {i}: expected {fmt(want.flatten()[i].item())}, "
            f"got {fmt(got.flatten()[i].item())}")


def _diagnose_gradient(got, want, local, world_size, last=None, micro=1):
    """Why a gradient differs from the reference: summed, never averaged, one micro-batch only, divided by the
    number of micro-batches, or just wrong."""
    if got is None:
        return "no gradient (None) after finish_gradient_synchronization()"
    if got.shape != want.shape:
        return f"gradient of shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if close(got, want * world_size):
        return (f"the SUM over the {world_size} ranks, not the average: divide by the world size "
                f"({_first_difference(got, want)})")
    if local is not None and close(got, local):
        return ("this rank's own gradient, never averaged: was its bucket all-reduced, and waited for "
                f"in finish_gradient_synchronization()? ({_first_difference(got, want)})")
    if local is not None and close(got, local / world_size):
        return (f"this rank's own gradient divided by {world_size}: the average was started but not completed. "
                "Did finish_gradient_synchronization() forget to wait()? Wait for every outstanding all-reduce, "
                "then copy each bucket's result back into the gradients "
                f"({_first_difference(got, want)})")
    if last is not None and close(got, last):
        return ("the average of the last micro-batch's gradient only: the micro-batches run inside no_sync() "
                "must stay in .grad (autograd adds each backward's gradient to it: do not zero, replace or "
                f"skip it), and the last backward averages the sum ({_first_difference(got, want)})")
    if micro > 1:
        for factor, what in ((1 / micro, f"divided by {micro}"), (micro, f"multiplied by {micro}")):
            if close(got, want * factor):
                return (f"the expected gradient {what}, the number of micro-batches per step: .grad must hold "
                        f"the SUM of the {micro} micro-batches' gradients, averaged over the ranks only (the "
                        "checks do not divide the loss by the number of micro-batches, as lesson 04 did; your "
                        f"wrapper must not either) ({_first_difference(got, want)})")
    return _first_difference(got, want)


def judge_construction(case, world_size, results, reference):
    """Problems with what Wrapper(...) left behind: broadcast state, `.module`, forward passthrough."""
    spec, problems = case["model"], []
    buffers = {name for name, _ in build_model(spec, 0).named_buffers()}
    for rank, r in enumerate(results):
        if not r["module_ok"]:
            problems.append(f"rank {rank}: wrapper.module is not the module passed to the wrapper "
                            "(store it as self.module)")
        for name, want in reference["init"].items():
            got = r["state"].get(name)
            if got is None:
                problems.append(f"rank {rank}, {label(spec, name)}: missing from the module after construction")
            elif not torch.equal(got, want):
                kind = "buffer" if name in buffers else "parameter"
                problems.append(f"rank {rank}, {kind} {label(spec, name)}: not rank 0's value after "
                                f"construction ({_first_difference(got, want)}): broadcast every parameter "
                                "and buffer from rank 0 in __init__")
        wrapped, plain = r["outputs"]
        if not (isinstance(wrapped, torch.Tensor) and wrapped.shape == plain.shape and close(wrapped, plain)):
            problems.append(f"rank {rank}: wrapper(x, y) returned {wrapped!r}, expected module(x, y) = "
                            f"{plain.item():.6g}: forward must pass its arguments to the module and return its result")
        elif not close(plain, reference["outputs"][rank]):
            problems.append(f"rank {rank}: the module's loss {plain.item():.6g} differs from rank 0's model on "
                            f"this rank's batch ({reference['outputs'][rank].item():.6g}): are all parameters "
                            "and buffers broadcast?")
    return problems


def judge_training(case, world_size, results, reference):
    """Problems with the gradients (every step) and the parameters after training, rank by rank.

    Stops at the first step with a wrong gradient (later steps start from wrong parameters).
    """
    spec, problems, local = case["model"], [], reference["local"]
    for step in range(case["steps"]):
        for rank, r in enumerate(results):
            for name, want in reference["grads"][step].items():
                got = r["grads"][step].get(name)
                if want is None:
                    if got is not None:
                        problems.append(f"rank {rank}, step {step}, {label(spec, name)}: has a gradient; a "
                                        "frozen parameter's .grad must stay None")
                    continue
                if got is not None and close(got, want):
                    continue
                mine = local[rank].get(name) if step == 0 else None
                last = reference.get("last", {}).get(name) if step == 0 else None
                problems.append(f"rank {rank}, step {step}, {label(spec, name)}: "
                                f"{_diagnose_gradient(got, want, mine, world_size, last, micro_batches(case))}")
        if problems:
            return problems
    for rank, r in enumerate(results):
        for name, want in reference["params"].items():
            got = r["params"].get(name)
            if got is None or not close(got, want):
                problems.append(f"rank {rank}, {label(spec, name)} after {case['steps']} SGD steps: "
                                + ("missing" if got is None else _first_difference(got, want)))
    return problems


def nominal_step_bytes(spec, world_size):
    """Bytes a rank sends per step when every trainable gradient is all-reduced once (a ring's 2(N−1)/N·M)."""
    return 2 * (world_size - 1) * gradient_bytes(spec) / world_size


def judge_traffic(case, world_size, results):
    """Problems with the bytes each rank sends per step: every trainable gradient once, nothing else."""
    want = nominal_step_bytes(case["model"], world_size)
    problems = []
    for rank, r in enumerate(results):
        for step, (sent, events) in enumerate(zip(r["bytes"], r["events"])):
            calls = sum(1 for e in events if e[0] == "comm")
            if abs(sent - want) <= calls:  # each collective's nominal count is rounded down to whole bytes
                continue
            more = ("more: a gradient communicated twice (a tied parameter registered under both its names?), "
                    "or something else sent between forward and the end of finish_gradient_synchronization(), "
                    "such as a broadcast of the buffers in every forward (broadcast them once, when the wrapper "
                    "is built)" if sent > want else "less: some gradient was not communicated")
            problems.append(f"rank {rank}, step {step}: sent {sent:,} bytes (nominal), expected {want:,.0f} = "
                            f"2(N-1)/N × {gradient_bytes(case['model']):,} bytes of trainable gradients, each "
                            f"once; {more}")
            break
    return problems


def _payload(sent, world_size):
    """The bytes an all-reduce carried, from its nominal sent bytes (2(N−1)/N of them, rounded down)."""
    return sent * world_size / (2 * (world_size - 1))


def judge_buckets(case, world_size, results):
    """Problems with the bucket sizes in the last step (the first may learn the arrival order): at a cap
    smaller than any trainable gradient one all-reduce per gradient, at a cap larger than all of them one
    all-reduce, and at every cap no bucket over the cap by more than one gradient (the one that closed it).
    Any rule within those limits passes: buckets planned at construction, closed before or after the cap."""
    spec, cap = case["model"], case["bucket_size_mb"] * MiB
    sizes = [p.numel() * p.element_size() for p in build_model(spec, 0).parameters() if p.requires_grad]
    if not sizes:
        return []
    total, largest = sum(sizes), max(sizes)
    problems = []
    for rank, r in enumerate(results):
        calls = [_payload(e[2], world_size) for e in (r["events"] or [[]])[-1]
                 if e[0] == "comm" and e[1] == "all_reduce"]
        if not calls:
            continue   # judge_traffic says what was sent instead
        shown = ", ".join(f"{c:,.0f}" for c in calls[:12]) + (", …" if len(calls) > 12 else "")
        seen = f"{len(calls)} all-reduce{'s' if len(calls) > 1 else ''} of {shown} bytes"
        if cap < min(sizes) and len(calls) != len(sizes):
            problems.append(f"rank {rank}, last step: buckets of {cap:,.0f} bytes, smaller than any of the "
                            f"{len(sizes)} trainable gradients, must give one all-reduce per gradient "
                            f"({len(sizes)}); seen {seen}: a bucket closes once the next gradient would not fit "
                            "(or once it reaches bucket_size_mb), so each gradient here is a bucket of its own")
        elif cap >= total and len(calls) != 1:
            problems.append(f"rank {rank}, last step: buckets of {cap:,.0f} bytes, more than all {total:,} bytes "
                            f"of trainable gradients, must give one all-reduce; seen {seen}: size your buckets "
                            "by bucket_size_mb (2**20 bytes per MiB) rather than one per parameter")
        elif max(calls) > cap + largest + 1:
            problems.append(f"rank {rank}, last step: a bucket of {max(calls):,.0f} bytes, more than the cap "
                            f"({cap:,.0f} bytes) plus the largest gradient ({largest:,}): seen {seen}; close a "
                            "bucket when it reaches bucket_size_mb (or before a gradient would take it over)")
    return problems


def judge_waits(case, world_size, results):
    """Problems with handles never waited for: every asynchronous call must be waited for before
    finish_gradient_synchronization() returns (until then it may still be writing its result)."""
    problems = []
    for rank, r in enumerate(results):
        for step, events in enumerate(r["events"]):
            calls = handles.fates(events)
            never = [b for b, fate, *_ in calls if fate == handles.NEVER_WAITED]
            if never:
                problems.append(f"rank {rank}, step {step}: {len(never)} of the {len(calls)} calls returned a handle "
                                f"that was never waited for ({sum(never):,} B) before finish_gradient_"
                                "synchronization() returned: wait for every handle there (work.wait(), or its "
                                "future's wait()); until then the all-reduce may still be writing into its tensor "
                                "when the optimizer reads the gradients")
                break
    return problems


def judge_quiet(case, world_size, results):
    """Problems with the micro-batches run inside no_sync(): nothing may be sent there."""
    k, problems = micro_batches(case), []
    for rank, r in enumerate(results):
        loud = [(step, micro, sent, calls) for step, quiet in enumerate(r["quiet"])
                for micro, (sent, calls) in enumerate(quiet) if sent or calls]
        if loud:
            step, micro, sent, calls = loud[0]
            problems.append(f"rank {rank}, step {step}, micro-batch {micro + 1} of {k} (inside no_sync()): {calls} "
                            f"communication call{'s' if calls != 1 else ''}, {sent:,} bytes (nominal) sent; inside "
                            "no_sync() backward must only accumulate into .grad: the gradient hooks return "
                            "without filling or launching a bucket, and the next backward outside no_sync() "
                            "averages the accumulated sums")
    return problems


def overlap_share(events):
    """(bytes still in flight when a later gradient became ready, all bytes sent) for one rank's step.

    A call counts when it returned a handle, a gradient became ready after it, and the handle was first waited
    for after that gradient (handles.fates): order of occurrence decides, not durations.
    """
    calls = handles.fates(events)
    return (sum(b for b, fate, *_ in calls if fate == handles.IN_FLIGHT), sum(b for b, *_ in calls))


_SUFFIX = {handles.IN_FLIGHT: " (waited after gradient {waited}/{n})", handles.BLOCKING: " (blocking)",
           handles.WAITED_AT_ONCE: " (waited before the next gradient)", handles.NEVER_WAITED: " (never waited)",
           handles.AFTER_BACKWARD: ""}


def describe_trace(events):
    """'b B after gradient k/n (how it was waited for)' for each call of a step: what the feedback shows."""
    n = sum(1 for e in events if e[0] == "grad")
    return ", ".join(f"{b:,} B after gradient {before}/{n}" + _SUFFIX[fate].format(waited=waited, n=n)
                     for b, fate, before, waited in handles.fates(events)) or "none"


_WHY = {
    handles.BLOCKING: "{calls} blocking (dist.send or dist.recv, or a collective without async_op=True: it "
                      "returns only once its data has moved)",
    handles.WAITED_AT_ONCE: "{calls} waited for before the next gradient was ready",
    handles.AFTER_BACKWARD: "{calls} issued once the last gradient was ready (from its hook, or in "
                            "finish_gradient_synchronization())",
    handles.NEVER_WAITED: "{calls} never waited for",
}


def _stall(what, ready, issued, n):
    """One stall, in words: what backward was made to wait for, and when."""
    if issued is not None:
        return (f"{what} after gradient {ready}/{n} on the handle of a call issued after gradient {issued}/{n}"
                + (" (right after the call)" if issued == ready else " (an earlier bucket's)"))
    if what == "barrier":
        return (f"a blocking dist.barrier() after gradient {ready}/{n} (a barrier waits for the other ranks, and on "
                "gloo for every collective issued before it)")
    if what in ("send", "recv"):
        return f"a blocking dist.{what}() after gradient {ready}/{n} (it returns once its data has moved)"
    return f"dist.{what}() without async_op=True after gradient {ready}/{n} (it returns only once it is done)"


def judge_overlap(case, world_size, results, share=EARLY_SHARE):
    """Problems with the overlap of the LAST step (a wrapper may learn the arrival order in its first): backward
    never made to wait for communication (`handles.stalls`), at least `share` of the gradient bytes in flight
    while later gradients are computed; every handle of every step waited for."""
    problems = judge_waits(case, world_size, results)
    for rank, r in enumerate(results):
        events = r["events"][-1]
        n = sum(1 for e in events if e[0] == "grad")
        stalled = handles.stalls(events)
        early, total = overlap_share(events)
        if stalled:
            shown = "; ".join(_stall(*s, n) for s in stalled[:3]) + (
                f"; and {len(stalled) - 3} more" if len(stalled) > 3 else "")
            problems.append(f"rank {rank}, last step: backward was made to wait for communication {len(stalled)} "
                            f"time{'s' if len(stalled) > 1 else ''} before its last gradient was ready: {shown}. "
                            "Overlap means backward never waits: from a gradient hook only start calls "
                            "(async_op=True), keep their handles and return; wait for them once the last gradient "
                            "is ready (in finish_gradient_synchronization(), or a callback run when backward ends)")
        elif total == 0:
            problems.append(f"rank {rank}: no collective seen in the last step (the checks see dist.<collective> "
                            "calls made between forward and the end of finish_gradient_synchronization())")
        elif early < share * total:
            late = {}
            for b, fate, *_ in handles.fates(events):
                if fate != handles.IN_FLIGHT:
                    calls, sent = late.get(fate, (0, 0))
                    late[fate] = (calls + 1, sent + b)
            why = "; ".join(_WHY[fate].format(calls=f"{c} call{'s' if c > 1 else ''} ({b:,} B)")
                            for fate, (c, b) in late.items())
            problems.append(f"rank {rank}, last step: {early:,} of {total:,} gradient bytes ({early / total:.0%}) "
                            f"were still in flight when a later gradient became ready; at least {share:.0%} must. "
                            f"Seen: {why}. Start each bucket's all-reduce with async_op=True from the hook of the "
                            "gradient that fills it, keep the handle and return; wait for every handle in "
                            f"finish_gradient_synchronization(). Your calls: {describe_trace(events)}")
    return problems

