"""Lab 2's checks (labs/lab2_ddp.ipynb): a bucketed, overlapping DDP wrapper.

The contract: `Wrapper(module, bucket_size_mb)` broadcasts rank 0's parameters and buffers when built,
exposes `.module`, passes `forward` through, averages gradients in buckets launched from gradient hooks, and
`finish_gradient_synchronization()` waits for them before `optimizer.step()`. Frozen parameters are left
alone; a tied parameter is synchronised once. Inside `with wrapper.no_sync():` backward only accumulates into
`.grad` (nothing is sent); the next backward outside it averages the accumulated gradients.

Each check prints one ✓ line per world size, saying what it verified, or raises a `LabCheckFailure` that says
what to fix (rank, parameter, expected vs got):
  check_construction(Wrapper)   broadcast of rank 0's parameters and buffers, `.module`, forward
  check_training(Wrapper)       gradients and parameters = single-process training, every bucket size and model;
                                buckets within the cap (one call per gradient at a tiny cap, one call at a cap
                                larger than the model)
  check_overlap(Wrapper)        backward never waits for communication (no wait, barrier or blocking call from a
                                gradient hook before the last gradient), most gradient bytes in flight while
                                later gradients are computed; every handle waited for
  check_accumulation(Wrapper)   no_sync(): nothing sent on the first k−1 micro-batches, the average over the
                                ranks of the accumulated sums after the k-th

Three layers, so that a grader can judge in a process that runs no student code:
  1. what a rank runs (`run_cases`, student code inside): it returns plain data only — per case a dict of
     CPU tensors by parameter name, byte counts and an event trace (see `run_case`);
  2. the reference (`reference_run`, lab2_cases.py): single-process training, computed from the case alone;
  3. the judges (lab2_judges.py): pure functions of (case, world size, the ranks' data, the reference)
     returning a list of problems (empty: passed).
A case is plain data too (lab2_cases.py: model spec, bucket size, steps, micro-batches per step, seed), so it
can travel anywhere. Which handles a rank waits for, and when, is recorded by `handles.track` (handles.py).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .. import bytecount, launching, trace
from ..checks import check
from . import handles
from .harness import TIMEOUT, report, run_on_ranks
from .lab2_cases import (ACCUMULATION, ATOL, BUCKET_SIZES_MB, EARLY_SHARE, FROZEN, LR, MODELS,  # noqa: F401
                         OVERLAP, OVERLAP_BUCKET_MB, PLAIN, RTOL, SHUFFLED, TIED, LabModel, MiB, build_model,
                         global_batch, gradient_bytes, label, make_case, micro_batches, rank_inputs, rank_seed,
                         reference_run, shard, trainable_names, _state)
from .lab2_judges import (close, describe_trace, judge_buckets, judge_construction, judge_overlap,  # noqa: F401
                          judge_quiet, judge_traffic, judge_training, judge_waits, nominal_step_bytes,
                          overlap_share)

WORLD_SIZES = (2, 4)


# ------------------------------------------------------------------ 1. what runs on every rank

def run_case(Wrapper, case, inputs=None):
    """Train the student's wrapper on this rank; return plain data (CPU tensors, numbers, tuples).

    inputs: this rank's `rank_inputs` (a grader sends each rank only its own, and no seed); by default they are
    made here from the case's seed.

    Returned dict:
      state      {name: tensor} parameters and buffers right after Wrapper(...) was built
      module_ok  `wrapper.module is` the model handed in
      outputs    (wrapper(x, y), model(x, y)) on this rank's first batch, before any training
      grads      per step {name: tensor or None} after finish_gradient_synchronization()
      params     {name: tensor} after the last optimizer step
      bytes      per step: nominal bytes this rank sent in the last micro-batch's forward, backward and
                 finish_gradient_synchronization()
      quiet      per step, per micro-batch run inside no_sync() (k−1 of them): (bytes sent, calls made)
      events     per step (its last micro-batch), in order of occurrence, each (kind, name, bytes, t, handle):
                 ("grad", parameter, 0, t, −1) when a gradient is ready (a hook registered before the
                 wrapper's), ("comm", op, nominal bytes sent, t, handle) when a call returns (handle −1: it
                 returned no handle, it was blocking), ("wait", how, 0, t, handle) when the handle is first
                 waited for (see handles.py); t on utils.trace's clock
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    device = launching.device()
    spec, k = case["model"], micro_batches(case)
    inputs = rank_inputs(case, rank, n) if inputs is None else inputs
    model = build_model(spec, 0)
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            t.copy_(inputs["state"][name])
    model = model.to(device)
    events = []
    for name, p in model.named_parameters():
        if p.requires_grad:  # registered before the wrapper's hooks: runs first on each gradient
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: events.append(("grad", name, 0, trace.now(), -1)))
    wrapper = Wrapper(model, case["bucket_size_mb"])
    result = dict(state=_state(model), module_ok=getattr(wrapper, "module", None) is model,
                  grads=[], bytes=[], quiet=[], events=[])
    x, y = (t.to(device) for t in inputs["batches"][0])
    with torch.no_grad():
        out = wrapper(x, y)
        out = out.detach().cpu() if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        result["outputs"] = (out, model(x, y).detach().cpu())
    if k > 1 and not callable(getattr(wrapper, "no_sync", None)):
        raise AttributeError(f"{type(wrapper).__name__} has no no_sync() method: add one, a context manager "
                             "(see part 4)")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(case["steps"]):
        quiet = []
        for micro in range(k):
            x, y = (t.to(device) for t in inputs["batches"][step * k + micro])
            events.clear()
            with bytecount.count_bytes() as counter:
                if micro < k - 1:
                    with wrapper.no_sync():
                        wrapper(x, y).backward()
                    quiet.append((counter.nominal_sent + counter.sent, len(counter.records)))
                    continue
                add = counter.add

                def recording_add(op, sent=0, received=0, *args, add=add, **kwargs):
                    events.append(("comm", op, int(sent), trace.now(), -1))   # handles.track numbers it
                    add(op, sent, received, *args, **kwargs)

                counter.add = recording_add
                with handles.track(events):
                    loss = wrapper(x, y)
                    loss.backward()
                    wrapper.finish_gradient_synchronization()
        result["bytes"].append(counter.nominal_sent + counter.sent)
        result["quiet"].append(quiet)
        result["events"].append(list(events))
        result["grads"].append({name: None if p.grad is None else p.grad.detach().clone().cpu()
                                for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result["params"] = {name: p.detach().clone().cpu() for name, p in model.named_parameters()}
    return result


def run_cases(Wrapper, cases):
    """run_case for every case, on this rank (the function `run_on_ranks` launches)."""
    return [run_case(Wrapper, case) for case in cases]


# ------------------------------------------------------------------ the visible checks

WHAT = "your DDP wrapper"
DEADLOCK = ("Usual causes: a collective that some ranks skip or issue in another order (every rank must "
            "issue the same all-reduces, of the same sizes, in the same order: a bucket launched on a condition "
            "that differs between ranks hangs the others); gradient hooks firing a different number of times "
            "than your wrapper counts (autograd calls a tied parameter's hook once, after both uses; a frozen "
            "parameter's never), so a bucket is never launched, or finish_gradient_synchronization() waits for "
            "one that was never launched; a dist.broadcast in __init__ that only rank 0 calls (every rank "
            "calls it, with src=0).")


def _run(Wrapper, cases, world_size, timeout):
    return run_on_ranks(run_cases, Wrapper, cases, world_size=world_size, what=WHAT, timeout=timeout,
                        deadlock_hint=DEADLOCK)


def _describe(spec):
    return f"model '{spec['name']}'"


def check_construction(Wrapper, world_sizes=WORLD_SIZES, model=FROZEN, timeout=TIMEOUT, seed=0):
    """Every rank holds rank 0's parameters and buffers after Wrapper(...); `.module`; forward passes through."""
    case = make_case(model, BUCKET_SIZES_MB[1], steps=1, seed=seed)
    for n in world_sizes:
        results = [rank[0] for rank in _run(Wrapper, [case], n, timeout)]
        report(f"{WHAT}, construction", n, judge_construction(case, n, results, reference_run(case, n)))
        check(True, f"construction at N={n}: every rank holds rank 0's parameters and buffers, .module is the "
                    "model, forward passes through")


def check_training(Wrapper, world_sizes=WORLD_SIZES, models=MODELS, bucket_sizes_mb=BUCKET_SIZES_MB, steps=3,
                   timeout=TIMEOUT, seed=0):
    """Gradients after every step and parameters after `steps` SGD steps = single-process training, for every
    model and bucket size; each rank sends every trainable gradient once per step."""
    cases = [make_case(m, b, steps=steps, seed=seed + i) for i, (m, b) in
             enumerate(itertools.product(models, bucket_sizes_mb))]
    for n in world_sizes:
        per_rank = _run(Wrapper, cases, n, timeout)
        for i, case in enumerate(cases):
            results = [rank[i] for rank in per_rank]
            reference = reference_run(case, n)
            what = f"{WHAT}, {_describe(case['model'])}, buckets of {case['bucket_size_mb']:g} MiB"
            report(what, n, judge_training(case, n, results, reference))
            report(what, n, judge_traffic(case, n, results))
            report(what, n, judge_waits(case, n, results))
            report(what, n, judge_buckets(case, n, results))
        names = ", ".join(dict.fromkeys(f"'{m['name']}'" for m in models))
        sizes = ", ".join(f"{b:g}" for b in bucket_sizes_mb)
        check(True, f"training at N={n}: gradients and parameters after {steps} SGD steps = one process on the "
                    f"whole batch (rtol {RTOL:.0e}), models {names}, buckets of {sizes} MiB; every trainable "
                    "gradient sent once per step, in buckets within the cap, every handle waited for")


def check_overlap(Wrapper, world_sizes=WORLD_SIZES, model=OVERLAP, bucket_size_mb=OVERLAP_BUCKET_MB, steps=2,
                  share=EARLY_SHARE, timeout=TIMEOUT, seed=0):
    """At least `share` of the last step's gradient bytes are still in flight when a later gradient becomes
    ready; every handle is waited for before finish_gradient_synchronization() returns (and the training is
    right)."""
    case = make_case(model, bucket_size_mb, steps=steps, seed=seed)
    for n in world_sizes:
        results = [rank[0] for rank in _run(Wrapper, [case], n, timeout)]
        what = f"{WHAT}, overlap ({_describe(model)}, buckets of {bucket_size_mb:g} MiB)"
        report(what, n, judge_training(case, n, results, reference_run(case, n)))
        report(what, n, judge_overlap(case, n, results, share))
        shares = [overlap_share(r["events"][-1]) for r in results]
        low = min(early / total for early, total in shares)
        check(True, f"overlap at N={n}: backward never waited for communication (no wait, barrier or blocking "
                    f"call before the last gradient); on every rank at least {low:.0%} of the gradient bytes were "
                    f"still in flight when a later gradient became ready ({_describe(model)}, buckets of "
                    f"{bucket_size_mb:g} MiB; at least {share:.0%} required), every handle waited for")


def check_accumulation(Wrapper, world_sizes=WORLD_SIZES, models=(PLAIN, TIED), bucket_size_mb=BUCKET_SIZES_MB[1],
                       accumulation=ACCUMULATION, steps=2, timeout=TIMEOUT, seed=0):
    """no_sync(): the first k−1 micro-batches of every step send nothing; after the k-th, the gradients are the
    average of the accumulated sums (= one process accumulating the k whole micro-batches), every trainable
    gradient sent once."""
    cases = [make_case(m, bucket_size_mb, steps=steps, seed=seed + i, accumulation=accumulation)
             for i, m in enumerate(models)]
    for n in world_sizes:
        per_rank = _run(Wrapper, cases, n, timeout)
        for i, case in enumerate(cases):
            results = [rank[i] for rank in per_rank]
            what = (f"{WHAT}, gradient accumulation ({_describe(case['model'])}, {accumulation} micro-batches per "
                    f"step, buckets of {bucket_size_mb:g} MiB)")
            report(what, n, judge_quiet(case, n, results))
            report(what, n, judge_training(case, n, results, reference_run(case, n)))
            report(what, n, judge_traffic(case, n, results))
            report(what, n, judge_waits(case, n, results))
        names = ", ".join(f"'{m['name']}'" for m in models)
        quiet = "micro-batch 1" if accumulation == 2 else f"micro-batches 1–{accumulation - 1}"
        check(True, f"accumulation at N={n}: nothing sent on {quiet} of {accumulation} (inside no_sync()); after "
                    f"the last, gradients and parameters after {steps} SGD "
                    f"steps = one process accumulating the {accumulation} whole micro-batches (rtol {RTOL:.0e}), "
                    f"models {names}")
