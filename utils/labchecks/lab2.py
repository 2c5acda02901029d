"""Lab 2's checks (labs/lab2_ddp.ipynb): a bucketed, overlapping DDP wrapper.

The contract: `Wrapper(module, bucket_size_mb)` broadcasts rank 0's parameters and buffers when built,
exposes `.module`, passes `forward` through, averages gradients in buckets launched from gradient hooks, and
`finish_gradient_synchronization()` waits for them before `optimizer.step()`. Frozen parameters are left
alone; a tied parameter is synchronised once. Inside `with wrapper.no_sync():` backward only accumulates into
`.grad` (nothing is sent); the next backward outside it averages the accumulated gradients.

Each check prints one ✓ line per world size, saying what it verified, or raises a `LabCheckFailure` that says
what to fix (rank, parameter, expected vs got):
  check_construction(Wrapper)   broadcast of rank 0's parameters and buffers, `.module`, forward
  check_training(Wrapper)       gradients and parameters = single-process training, every bucket size and model
  check_overlap(Wrapper)        most gradient bytes still in flight while later gradients are computed; every
                                handle waited for before finish_gradient_synchronization() returns
  check_accumulation(Wrapper)   no_sync(): nothing sent on the first k−1 micro-batches, the average of the
                                accumulated gradients after the k-th

Three layers, so that a grader can judge in a process that runs no student code:
  1. what a rank runs (`run_cases`, student code inside): it returns plain data only — per case a dict of
     CPU tensors by parameter name, byte counts and an event trace (see `run_case`);
  2. the reference (`reference_run`): single-process training, computed from the case alone;
  3. the judges (`judge_construction`, `judge_training`, `judge_traffic`, `judge_waits`, `judge_quiet`,
     `judge_overlap`): pure functions of
     (case, world size, the ranks' data, the reference) returning a list of problems (empty: passed).
A case is plain data too (a dict: model spec, bucket size, steps, micro-batches per step, seed), so it can
travel anywhere. Which handles a rank waits for, and when, is recorded by `handles.track` (handles.py).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .. import bytecount, launching, trace
from ..checks import check
from . import handles
from .harness import TIMEOUT, fmt, report, run_on_ranks

WORLD_SIZES = (2, 4)
MiB = 2**20
LR = 0.1                 # plain SGD: parameters after k steps differ from the reference only by round-off
RTOL, ATOL = 1e-4, 1e-6  # float32 sums in another order agree far closer; a sum instead of a mean is ×N off
EARLY_SHARE = 0.5        # at least this share of a step's gradient bytes must be in flight while later gradients come


# ------------------------------------------------------------------ the models (plain-data specs)

class LabModel(torch.nn.Module):
    """A tiny language model: embedding (+ a fixed `shift` buffer), tanh layers, a head; loss = cross-entropy.

    spec: vocab, widths (embedding width, then each layer's output width), tied (head weight = embedding),
    frozen (names of parameters with requires_grad=False), order (the layers' indices in the order forward
    applies them; default: as defined; needs equal widths).
    """

    def __init__(self, spec):
        super().__init__()
        widths = spec["widths"]
        self.wte = torch.nn.Embedding(spec["vocab"], widths[0])
        self.register_buffer("shift", torch.randn(widths[0]))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.order = list(spec.get("order", range(len(self.layers))))
        self.head = torch.nn.Linear(widths[-1], spec["vocab"], bias=False)
        if spec.get("tied"):
            self.head.weight = self.wte.weight  # one Parameter, used twice
        for name, p in self.named_parameters():
            if name in spec.get("frozen", ()):
                p.requires_grad_(False)

    def forward(self, x, y):
        h = self.wte(x) + self.shift
        for i in self.order:
            h = torch.tanh(self.layers[i](h))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


# The models of the visible checks. In all but SHUFFLED every parameter's gradient is ready in the reverse of
# the order the parameters are defined in (the embedding last), so buckets filled in arrival order and buckets
# planned in reverse definition order are the same. SHUFFLED applies its layers in another order than it
# defines them: its gradients arrive out of definition order (judged on correctness only: right gradients, no
# hang; the overlap model keeps reverse definition order, so a plan fixed that way keeps its overlap).
PLAIN = dict(name="plain", vocab=16, widths=[32, 32, 32, 32])
FROZEN = dict(name="frozen", vocab=16, widths=[32, 32, 32, 32], frozen=["layers.0.weight", "layers.0.bias",
                                                                       "layers.2.bias"])
TIED = dict(name="tied", vocab=16, widths=[32, 32, 32], tied=True)
OVERLAP = dict(name="eight equal layers", vocab=16, widths=[64] * 9)   # 8 layers of 16.6 KB, 4 KB head
SHUFFLED = dict(name="shuffled", vocab=16, widths=[32] * 5, order=[2, 0, 3, 1])
MODELS = (PLAIN, FROZEN, TIED, SHUFFLED)
# bucket sizes in MiB: smaller than any parameter (a 32-float bias is 128 bytes), medium, larger than the model
BUCKET_SIZES_MB = (1e-5, 1 / 128, 4.0)
OVERLAP_BUCKET_MB = 1 / 32   # 32 KiB: about two of OVERLAP's layers per bucket
ACCUMULATION = 3             # micro-batches per step in the no_sync() check


def make_case(model, bucket_size_mb, steps=3, batch=12, seq_len=6, seed=0, accumulation=1):
    """One case, as plain data. accumulation = k: each step is k micro-batches, the first k−1 in no_sync()."""
    return dict(model=dict(model), bucket_size_mb=bucket_size_mb, steps=steps, batch=batch, seq_len=seq_len,
                seed=seed, accumulation=accumulation)


def micro_batches(case):
    return case.get("accumulation", 1)


def build_model(spec, seed):
    """The case's model, initialised from `seed` (ranks use different seeds: the wrapper must broadcast)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LabModel(spec)


def rank_seed(case, rank):
    return 1000 * case["seed"] + 17 * rank + 1


def global_batch(case, step, micro=0):
    """(x, y): the whole batch of a step's micro-batch; rank r trains on rows r·B/N … (r+1)·B/N − 1."""
    generator = torch.Generator().manual_seed(7919 * case["seed"] + step + 1_000_003 * micro)
    shape = (case["batch"], case["seq_len"])
    vocab = case["model"]["vocab"]
    return (torch.randint(0, vocab, shape, generator=generator),
            torch.randint(0, vocab, shape, generator=generator))


def shard(tensor, rank, world_size):
    return tensor.tensor_split(world_size)[rank]


def trainable_names(spec):
    """Names (deduplicated, as named_parameters() gives them) of the parameters that get gradients."""
    return [name for name, p in build_model(spec, 0).named_parameters() if p.requires_grad]


def label(spec, name):
    """A parameter's name, with what is special about it."""
    if spec.get("tied") and name == "wte.weight":
        return "wte.weight (tied: also head.weight)"
    if name in spec.get("frozen", ()):
        return f"{name} (frozen)"
    return name


def gradient_bytes(spec):
    """Bytes of the gradients that must be synchronised: trainable parameters, a tied one once."""
    model = build_model(spec, 0)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------ 1. what runs on every rank

def _state(module):
    return {name: t.detach().clone().cpu() for name, t in
            itertools.chain(module.named_parameters(), module.named_buffers())}


def rank_inputs(case, rank, world_size):
    """What rank `rank` trains on, and nothing more: its initial parameters and buffers (different per rank: the
    wrapper must broadcast rank 0's), and its shard (x, y) of every step's micro-batches, in order (step 0's
    first also for forward)."""
    state = _state(build_model(case["model"], rank_seed(case, rank)))
    batches = [tuple(shard(t, rank, world_size) for t in global_batch(case, step, micro))
               for step in range(max(case["steps"], 1)) for micro in range(micro_batches(case))]
    return dict(state=state, batches=batches)


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

                def recording_add(op, sent=0, received=0, peer=None, nominal=False, asynchronous=False, add=add):
                    events.append(("comm", op, int(sent), trace.now(), -1))   # handles.track numbers it
                    add(op, sent, received, peer, nominal, asynchronous)

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


# ------------------------------------------------------------------ 2. the reference (no student code)

def reference_run(case, world_size):
    """Single-process training on the whole batch, from rank 0's initial weights.

    Returns dict(init={name: tensor} rank 0's parameters and buffers before broadcast, outputs=[loss of rank
    r's shard at init], grads=[{name: grad} per step, summed over its micro-batches], params={name: tensor}
    after the last step, local=[{name: grad} of rank r's shard alone at step 0, summed over its micro-batches],
    last={name: grad} of step 0's last micro-batch alone, when a step has several).
    """
    spec, k = case["model"], micro_batches(case)
    model = build_model(spec, rank_seed(case, 0))
    init = _state(model)
    outputs, local = [], []

    def gradients():
        return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}

    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        for micro in range(k):
            x, y = global_batch(case, 0, micro)
            loss = model(shard(x, r, world_size), shard(y, r, world_size))
            loss.backward()
            if micro == 0:
                outputs.append(loss.detach())
        local.append({name: g for name, g in gradients().items() if g is not None})
    extra = {}
    if k > 1:
        model.zero_grad(set_to_none=True)
        model(*global_batch(case, 0, k - 1)).backward()
        extra["last"] = gradients()
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(case["steps"]):
        for micro in range(k):   # autograd adds each micro-batch's gradient to .grad
            model(*global_batch(case, step, micro)).backward()
        grads.append(gradients())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(init=init, outputs=outputs, local=local, grads=grads, **extra,
                params={name: p.detach().clone() for name, p in model.named_parameters()})


# ------------------------------------------------------------------ 3. the judges (pure functions)

def close(got, want):
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL)


def _first_difference(got, want):
    diff = (got.double() - want.double()).abs()
    i = int(diff.flatten().argmax())
    return (f"max |diff| {diff.max().item():.3g} at element {i}: expected {fmt(want.flatten()[i].item())}, "
            f"got {fmt(got.flatten()[i].item())}")


def _diagnose_gradient(got, want, local, world_size, last=None):
    """Why a gradient differs from the reference: summed, never averaged, one micro-batch only, or just wrong."""
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
                                f"{_diagnose_gradient(got, want, mine, world_size, last)}")
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
                      "returns only once its data has moved, so backward waited for it)",
    handles.WAITED_AT_ONCE: "{calls} waited for before the next gradient was ready (a wait() right after the "
                            "call, in the hook: backward waited for it)",
    handles.AFTER_BACKWARD: "{calls} issued once the last gradient was ready (from its hook, or in "
                            "finish_gradient_synchronization())",
    handles.NEVER_WAITED: "{calls} never waited for",
}


def judge_overlap(case, world_size, results, share=EARLY_SHARE):
    """Problems with the overlap of the LAST step (a wrapper may learn the arrival order in its first); every
    handle of every step waited for."""
    problems = judge_waits(case, world_size, results)
    for rank, r in enumerate(results):
        events = r["events"][-1]
        early, total = overlap_share(events)
        if total == 0:
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
        names = ", ".join(dict.fromkeys(f"'{m['name']}'" for m in models))
        sizes = ", ".join(f"{b:g}" for b in bucket_sizes_mb)
        check(True, f"training at N={n}: gradients and parameters after {steps} SGD steps = one process on the "
                    f"whole batch (rtol {RTOL:.0e}), models {names}, buckets of {sizes} MiB; every trainable "
                    "gradient sent once per step, every handle waited for")


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
        check(True, f"overlap at N={n}: on every rank at least {low:.0%} of the gradient bytes were still in flight "
                    f"when a later gradient became ready ({_describe(model)}, buckets of {bucket_size_mb:g} MiB; at "
                    f"least {share:.0%} required), every handle waited for")


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
