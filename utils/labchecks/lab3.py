"""Lab 3's checks (labs/lab3_sharded_optimizer.ipynb): a sharded optimizer (ZeRO stage 1).

The contract: `ShardedOptimizer(params, optimizer_cls, **kwargs)` is a `torch.optim.Optimizer`; each rank
keeps optimizer state only for its shard of the parameters; `step()` updates that shard with
`optimizer_cls(**kwargs)` and synchronises the parameters, so every rank ends the step with the parameters
one unsharded `optimizer_cls` would produce. Gradients arrive already averaged over the ranks (as DDP leaves
them); parameters without a gradient are left alone; `add_param_group` works mid-training.

Each check prints one ✓ line per world size, saying what it verified, or raises a `LabCheckFailure` that says
what to fix (rank, parameter, step, expected vs got):
  check_training(ShardedOptimizer)        parameters after every step = the unsharded optimizer's
  check_sharded_state(ShardedOptimizer)   each rank's optimizer state ≤ 1/N of the unsharded + the largest parameter's
  check_synchronisation(ShardedOptimizer) one rank's parameters perturbed before a step: identical again after it
  check_param_groups(ShardedOptimizer)    add_param_group mid-training, with its own learning rate

Three layers, so that a grader can judge in a process that runs no student code:
  1. what a rank runs (`run_cases`, student code inside): it returns plain data only (see `run_case`);
  2. the reference (`reference_run`): the unsharded optimizer in one process, from the case and its inputs;
  3. the judges (`judge_training`, `judge_state`, `judge_synchronisation`): pure functions of
     (case, world size, the ranks' data, the reference) returning a list of problems (empty: passed).
A case is plain data (model spec, optimizer name and options, steps, seed); its inputs (initial parameters,
each step's gradients, a perturbation) are tensors drawn from a generator (`make_inputs`), so a grader can
draw them where students cannot predict them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import launching
from ..checks import check
from ..memory import unique_storage_bytes
from .harness import TIMEOUT, fmt, report, run_on_ranks

WORLD_SIZES = (2, 4)
STEPS = 10
RTOL, ATOL = 1e-5, 1e-7   # the same elementwise update in another layout agrees to round-off
SEEN_SHARE = 0.9          # the ranks' state together: at least this share of the unsharded (fewer step counters
                          # in a flat layout hold a little less; state kept out of sight, nothing)


# ------------------------------------------------------------------ the models and optimizers (plain data)

class LabModel(torch.nn.Module):
    """Parameters shaped like a tiny language model's: embedding, linear layers, a head.

    spec: vocab, widths (embedding width, then each layer's output width), tied (head weight = embedding),
    frozen (names of parameters with requires_grad=False), unused (names of trainable parameters that never
    get a gradient, as if forward did not use them). The checks never run forward: they hand every rank the
    gradients (the same on every rank, as DDP leaves them).
    """

    def __init__(self, spec):
        super().__init__()
        widths = spec["widths"]
        self.wte = torch.nn.Embedding(spec["vocab"], widths[0])
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.head = torch.nn.Linear(widths[-1], spec["vocab"], bias=False)
        if spec.get("tied"):
            if widths[0] != widths[-1]:
                raise ValueError(f"a tied model needs the head's input width = the embedding's, got widths {widths}")
            self.head.weight = self.wte.weight  # one Parameter under two names
        for name, p in self.named_parameters():
            if name in spec.get("frozen", ()):
                p.requires_grad_(False)


PLAIN = dict(name="plain", vocab=16, widths=[32, 48, 32])
FROZEN = dict(name="frozen and unused", vocab=16, widths=[32, 48, 48, 32],
              frozen=["layers.0.weight", "layers.1.bias"], unused=["layers.2.weight", "layers.2.bias"])
TIED = dict(name="tied", vocab=16, widths=[32, 48, 32], tied=True)
MODELS = (PLAIN, FROZEN, TIED)
ADAMW = ("AdamW", dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))
SGD = ("SGD", dict(lr=5e-2, momentum=0.9))
OPTIMIZERS = (ADAMW, SGD)
GROUP = dict(names=["wte.weight"], options=dict(lr=2e-2), step=3)   # added before step 3 with its own lr


def make_case(model, optimizer, steps=STEPS, seed=0, perturb=None, add_group=None):
    """One case, as plain data. perturb: dict(step, rank); add_group: dict(names, options, step)."""
    name, options = optimizer
    return dict(model=dict(model), optimizer=name, options=dict(options), steps=steps, seed=seed,
                perturb=perturb, add_group=add_group)


def build_model(spec):
    return LabModel(spec)


def optimizer_class(case):
    return getattr(torch.optim, case["optimizer"])


def options(values):
    """Optimizer options as torch wants them (a case that travelled as JSON has lists for tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def describe_optimizer(case):
    options = ", ".join(f"{k}={v}" for k, v in case["options"].items())
    return f"{case['optimizer']}({options})"


def names(spec):
    """Every parameter's name, as model.named_parameters() gives them (a tied parameter once)."""
    return [name for name, _ in build_model(spec).named_parameters()]


def gradient_names(spec):
    """The parameters that get a gradient: trainable and used."""
    return [name for name, p in build_model(spec).named_parameters()
            if p.requires_grad and name not in spec.get("unused", ())]


def label(spec, name):
    """A parameter's name, with what is special about it."""
    if spec.get("tied") and name == "wte.weight":
        return "wte.weight (tied: also head.weight)"
    if name in spec.get("frozen", ()):
        return f"{name} (frozen)"
    if name in spec.get("unused", ()):
        return f"{name} (no gradient)"
    return name


def make_inputs(case, draw=None):
    """The case's tensors: init {name: tensor}, grads [{name: tensor} per step], perturbation {name: tensor}.

    `draw(shape)` gives float32 values spread over [-1, 1] (default: uniform, from a generator seeded by the
    case; a grader passes its own unpredictable source). Gradients are O(1): every trainable parameter moves in
    every step, and no element's update hangs on round-off.
    """
    if draw is None:
        g = torch.Generator().manual_seed(7919 * case["seed"] + 1)
        draw = lambda shape: torch.rand(shape, generator=g) * 2 - 1  # noqa: E731
    shapes = {name: p.shape for name, p in build_model(case["model"]).named_parameters()}
    init = {name: 0.5 * draw(shape) for name, shape in shapes.items()}
    trained = gradient_names(case["model"])
    grads = [{name: draw(shapes[name]) for name in trained} for _ in range(case["steps"])]
    perturbation = {name: 0.1 * draw(shapes[name]) for name in trained} if case.get("perturb") else {}
    return dict(init=init, grads=grads, perturbation=perturbation)


def pack_inputs(case, inputs):
    """The inputs as one list of tensors in a fixed order (what a grader sends to a rank)."""
    every, trained = names(case["model"]), gradient_names(case["model"])
    return ([inputs["init"][n] for n in every] + [step[n] for step in inputs["grads"] for n in trained]
            + [inputs["perturbation"][n] for n in trained if inputs["perturbation"]])


def unpack_inputs(case, tensors):
    """pack_inputs, undone."""
    every, trained = names(case["model"]), gradient_names(case["model"])
    tensors = list(tensors)
    init = dict(zip(every, tensors[:len(every)]))
    rest = tensors[len(every):]
    grads = [dict(zip(trained, rest[s * len(trained):(s + 1) * len(trained)])) for s in range(case["steps"])]
    rest = rest[case["steps"] * len(trained):]
    return dict(init=init, grads=grads, perturbation=dict(zip(trained, rest)) if case.get("perturb") else {})


# ------------------------------------------------------------------ 1. what runs on every rank

def _optimizers_in(value, found, depth=3):
    """Every torch.optim.Optimizer in `value` (itself, or inside lists, tuples, sets and dicts, `depth` deep)."""
    if isinstance(value, torch.optim.Optimizer):
        if all(value is not o for o in found):
            found.append(value)
    elif depth and isinstance(value, (list, tuple, set, frozenset, dict)):
        for item in (value.values() if isinstance(value, dict) else value):
            _optimizers_in(item, found, depth - 1)
    return found


def state_bytes(optimizer):
    """Bytes of the tensors in `optimizer.state` and in the state of every optimizer it holds as an attribute
    (directly, or inside lists, tuples and dicts): what this rank keeps as optimizer state."""
    optimizers = [optimizer]
    for value in vars(optimizer).values():
        _optimizers_in(value, optimizers)
    # Only trainable parameters' state counts, here and in the unsharded reference: some optimizers (Adagrad)
    # create state for every parameter they are given, frozen ones included, which is no sharding question.
    tensors = [v for o in optimizers for param, state in getattr(o, "state", {}).items()
               if isinstance(state, dict) and getattr(param, "requires_grad", True)
               for v in state.values() if torch.is_tensor(v)]
    return unique_storage_bytes(tensors)


def run_case(Optimizer, case, inputs, device=None):
    """Train with the student's optimizer on this rank; return plain data (CPU tensors, numbers).

    Every rank starts from inputs["init"] and gets the same gradients each step (grad None for frozen and
    unused parameters). Returned dict:
      is_optimizer  isinstance(optimizer, torch.optim.Optimizer)
      params        per step {name: tensor} after optimizer.step()
      state_bytes   bytes of optimizer state on this rank after the last step (see `state_bytes`)
      group_sizes   [len(group["params"]) for each of optimizer.param_groups] after the last step
    """
    rank = dist.get_rank()
    device = device or launching.device()
    spec = case["model"]
    model = build_model(spec).to(device)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(inputs["init"][name])
    group = case.get("add_group") or {}
    first = [p for name, p in named.items() if name not in group.get("names", ())]
    optimizer = Optimizer(first, optimizer_class(case), **options(case["options"]))
    params = []
    for step in range(case["steps"]):
        if group and step == group["step"]:
            optimizer.add_param_group({"params": [named[n] for n in group["names"]], **options(group["options"])})
        for name, p in named.items():
            grad = inputs["grads"][step].get(name)
            p.grad = None if grad is None else grad.to(device).clone()
        perturb = case.get("perturb")
        if perturb and step == perturb["step"] and rank == perturb["rank"]:
            with torch.no_grad():
                for name, noise in inputs["perturbation"].items():
                    named[name].add_(noise.to(device))
        optimizer.step()
        params.append({name: p.detach().clone().cpu() for name, p in named.items()})
    is_optimizer = isinstance(optimizer, torch.optim.Optimizer)
    return dict(is_optimizer=is_optimizer, params=params, state_bytes=state_bytes(optimizer),
                group_sizes=[len(g["params"]) for g in optimizer.param_groups] if is_optimizer else [])


def run_cases(Optimizer, cases, inputs):
    """run_case for every case, on this rank (the function `run_on_ranks` launches)."""
    return [run_case(Optimizer, case, case_inputs) for case, case_inputs in zip(cases, inputs)]


# ------------------------------------------------------------------ 2. the reference (no student code)

def reference_run(case, inputs):
    """The unsharded optimizer in one process on the same inputs (no perturbation).

    Returns dict(init={name: tensor} before step 0, params=[{name: tensor} per step], state_bytes=total bytes
    of optimizer state after the last step, largest=`largest_state`, group_sizes).
    """
    model = build_model(case["model"])
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(inputs["init"][name])
    group = case.get("add_group") or {}
    optimizer = optimizer_class(case)([p for n, p in named.items() if n not in group.get("names", ())],
                                      **options(case["options"]))
    params = []
    for step in range(case["steps"]):
        if group and step == group["step"]:
            optimizer.add_param_group({"params": [named[n] for n in group["names"]], **options(group["options"])})
        for name, p in named.items():
            p.grad = inputs["grads"][step].get(name)
            p.grad = None if p.grad is None else p.grad.clone()
        optimizer.step()
        params.append({name: p.detach().clone() for name, p in named.items()})
    return dict(init=dict(inputs["init"]), params=params, state_bytes=sum(_per_parameter_state(optimizer)),
                largest=largest_state(case), group_sizes=[len(g["params"]) for g in optimizer.param_groups])


def _per_parameter_state(optimizer):
    """Bytes of state per trainable parameter (frozen parameters' state is not counted: see `state_bytes`)."""
    return [unique_storage_bytes(v for v in s.values() if torch.is_tensor(v))
            for param, s in optimizer.state.items() if param.requires_grad]


def largest_state(case):
    """Bytes of optimizer state the largest parameter would have (had every parameter a gradient): the most that
    sharing out whole parameters can leave on one rank beyond its 1/N, whichever parameters get gradients."""
    model = build_model(case["model"])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer = optimizer_class(case)(model.parameters(), **options(case["options"]))
    optimizer.step()
    return max(_per_parameter_state(optimizer), default=0)


# ------------------------------------------------------------------ 3. the judges (pure functions)

def close(got, want):
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL)


def first_difference(got, want):
    diff = (got.double() - want.double()).abs()
    i = int(diff.flatten().argmax())
    return (f"max |diff| {diff.max().item():.3g} at element {i}: expected {fmt(want.flatten()[i].item())}, "
            f"got {fmt(got.flatten()[i].item())}")


def _diagnose(got, want, before, step, nobody=False):
    """Why a parameter differs from the unsharded optimizer's after a step (`nobody`: no rank updated it)."""
    if got is None:
        return "missing"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if nobody and not torch.equal(before, want) and torch.equal(got, before):
        return (f"not updated in this step on any rank (every rank still holds its value from before step "
                f"{step}): no rank's inner optimizer updated it. Is it in the param_groups of the inner optimizer "
                "of the rank that owns it? A group added with add_param_group must reach the inner optimizer "
                "too (give the owner its share of the new group), and step() must call the inner optimizer's "
                f"step() ({first_difference(got, want)})")
    if not torch.equal(before, want) and torch.equal(got, before):
        return (f"not updated in this step (it still holds its value from before step {step}): the rank that "
                f"owns it updated it, but the new value never reached this rank — synchronise after the "
                f"shard's update ({first_difference(got, want)})")
    if torch.equal(before, want):
        return (f"changed in step {step}, which leaves it unchanged (it has no gradient, or is in no parameter "
                f"group yet): skip parameters whose .grad is None ({first_difference(got, want)})")
    return first_difference(got, want)


def _not_an_optimizer(results):
    return [f"rank {rank}: ShardedOptimizer(...) is not a torch.optim.Optimizer: subclass it and call "
            "super().__init__(params, defaults)" for rank, r in enumerate(results) if not r["is_optimizer"]][:1]


def judge_training(case, world_size, results, reference, steps=None):
    """Problems with the parameters after each step (all steps, or the first `steps`), rank by rank.

    Stops at the first step with a wrong parameter (later steps start from wrong values).
    """
    problems = _not_an_optimizer(results)
    if problems:
        return problems
    spec = case["model"]
    for step in range(case["steps"] if steps is None else steps):
        want_step = reference["params"][step]
        before = reference["params"][step - 1] if step else reference["init"]
        stale = {name for name in want_step if all(
            isinstance(r["params"][step].get(name), torch.Tensor) and torch.equal(r["params"][step][name], before[name])
            for r in results)}   # no rank holds a new value
        for rank, r in enumerate(results):
            for name, want in want_step.items():
                got = r["params"][step].get(name)
                if got is not None and close(got, want):
                    continue
                problems.append(f"rank {rank}, step {step}, {label(spec, name)}: "
                                f"{_diagnose(got, want, before[name], step, nobody=name in stale)}")
        if problems:
            return problems
    return problems


def state_bound(reference, world_size):
    """At most 1/N of the unsharded optimizer's state plus the state of its largest parameter."""
    return reference["state_bytes"] / world_size + reference["largest"]


def judge_state(case, world_size, state_bytes, reference):
    """Problems with each rank's optimizer state: `state_bytes` is one number per rank."""
    bound, total = state_bound(reference, world_size), reference["state_bytes"]
    problems = []
    for rank, held in enumerate(state_bytes):
        if held > bound:
            whole = " — all of it: every rank keeps state for every parameter" if held >= total else ""
            problems.append(f"rank {rank}: holds {held:,} bytes of optimizer state, at most {bound:,.0f} allowed "
                            f"(1/{world_size} of the unsharded {total:,} + {reference['largest']:,} for the "
                            f"largest parameter){whole}. Build the inner optimizer on this rank's shard only.")
    if not problems and sum(state_bytes) < SEEN_SHARE * total:
        problems.append(f"the ranks hold {sum(state_bytes):,} bytes of optimizer state together, far less than "
                        f"the unsharded {total:,}: the checks see the state in optimizer.state and in the state "
                        "of any torch.optim.Optimizer your optimizer keeps as an attribute (or inside a list, "
                        "tuple or dict attribute): keep the shard's optimizer there")
    return problems


def judge_synchronisation(case, world_size, results, reference):
    """Problems after a perturbation: every rank's parameters must be identical (bytes) after each step from
    the perturbed one on; before it, equal to the reference."""
    problems = judge_training(case, world_size, results, reference, steps=case["perturb"]["step"])
    if problems:
        return problems
    spec, victim = case["model"], case["perturb"]["rank"]
    for step in range(case["perturb"]["step"], case["steps"]):
        for rank, r in enumerate(results[1:], start=1):
            for name, want in results[0]["params"][step].items():
                got = r["params"][step][name]
                if not torch.equal(got, want):
                    why = (" (the perturbed rank)" if rank == victim else "")
                    problems.append(
                        f"rank {rank}{why}, step {step}, {label(spec, name)}: differs from rank 0's after the step "
                        f"({first_difference(got, want)}; rank 0's value is 'expected'). Rank {victim}'s parameters "
                        f"were perturbed before step {case['perturb']['step']}: step() must leave every rank "
                        "holding the owner's values (broadcast or all-gather every parameter from the rank "
                        "that updated it), not trust that the ranks still agree")
        if problems:
            return problems
    return problems


def judge_groups(case, world_size, results, reference):
    """Problems with param_groups after add_param_group: one group per call, every parameter in one group."""
    want = reference["group_sizes"]
    return [f"rank {rank}: optimizer.param_groups holds groups of {r['group_sizes']} parameters, expected "
            f"{want}: call super().add_param_group(group) in your add_param_group, so param_groups lists every "
            "parameter (schedulers and zero_grad() use it)" for rank, r in enumerate(results)
            if r["is_optimizer"] and r["group_sizes"] != want][:1]


# ------------------------------------------------------------------ the visible checks

WHAT = "your ShardedOptimizer"
DEADLOCK = ("Usual causes: a collective that only some ranks call, such as a dist.broadcast of a parameter that "
            "only its owner calls (every rank must call dist.broadcast(p, src=owner) for every parameter, in "
            "the same order); ranks that disagree on who owns which parameter (compute the split from the same "
            "parameter list, in the same order, on every rank); a collective skipped on some ranks only, e.g. "
            "for parameters without a gradient on this rank, or for a group added with add_param_group on the "
            "owner only; collectives of different sizes on different ranks (an all-gather needs equal shards).")


def _run(Optimizer, cases, world_size, timeout):
    inputs = [make_inputs(case) for case in cases]
    per_rank = run_on_ranks(run_cases, Optimizer, cases, inputs, world_size=world_size, what=WHAT, timeout=timeout,
                            deadlock_hint=DEADLOCK)
    return inputs, [[rank[i] for rank in per_rank] for i in range(len(cases))]


def _what(case):
    return f"{WHAT}, model '{case['model']['name']}', {describe_optimizer(case)}"


def check_training(Optimizer, world_sizes=WORLD_SIZES, models=MODELS, optimizers=OPTIMIZERS, steps=STEPS,
                   timeout=TIMEOUT, seed=0):
    """Parameters after every one of `steps` steps = the unsharded optimizer's, for every model and optimizer."""
    cases = [make_case(m, o, steps=steps, seed=seed + i) for i, (m, o) in
             enumerate((m, o) for o in optimizers for m in models)]
    for n in world_sizes:
        inputs, results = _run(Optimizer, cases, n, timeout)
        for case, case_inputs, case_results in zip(cases, inputs, results):
            report(_what(case), n, judge_training(case, n, case_results, reference_run(case, case_inputs)))
        names_ = ", ".join(dict.fromkeys(f"'{m['name']}'" for m in models))
        opts = ", ".join(o[0] for o in optimizers)
        check(True, f"training at N={n}: parameters after each of {steps} {opts} steps = the unsharded "
                    f"optimizer's on every rank (rtol {RTOL:.0e}), models {names_}")


def check_sharded_state(Optimizer, world_sizes=WORLD_SIZES, models=(PLAIN, FROZEN), optimizers=OPTIMIZERS,
                        steps=2, timeout=TIMEOUT, seed=0):
    """Each rank's optimizer state ≤ 1/N of the unsharded optimizer's + the state of its largest parameter."""
    cases = [make_case(m, o, steps=steps, seed=seed + i) for i, (m, o) in
             enumerate((m, o) for o in optimizers for m in models)]
    for n in world_sizes:
        inputs, results = _run(Optimizer, cases, n, timeout)
        shares = []
        for case, case_inputs, case_results in zip(cases, inputs, results):
            reference = reference_run(case, case_inputs)
            report(_what(case), n, judge_training(case, n, case_results, reference))
            held = [r["state_bytes"] for r in case_results]
            report(_what(case) + ", optimizer state", n, judge_state(case, n, held, reference))
            shares.append(max(held) / reference["state_bytes"])
        check(True, f"sharded state at N={n}: every rank holds at most 1/N of the unsharded optimizer's state "
                    f"plus its largest parameter's (here at most {max(shares):.0%} of it; 1/N = {1 / n:.0%})")


def check_synchronisation(Optimizer, world_sizes=WORLD_SIZES, model=PLAIN, optimizer=ADAMW, steps=4, at_step=2,
                          timeout=TIMEOUT, seed=0):
    """The last rank's parameters are perturbed before step `at_step`: every rank identical after each step."""
    for n in world_sizes:
        case = make_case(model, optimizer, steps=steps, seed=seed, perturb=dict(step=at_step, rank=n - 1))
        inputs, results = _run(Optimizer, [case], n, timeout)
        report(_what(case), n, judge_synchronisation(case, n, results[0], reference_run(case, inputs[0])))
        check(True, f"synchronisation at N={n}: rank {n - 1}'s parameters perturbed before step {at_step}; after "
                    "that step and the next, every rank holds the same parameters, byte for byte")


def check_param_groups(Optimizer, world_sizes=WORLD_SIZES, models=(PLAIN, TIED), optimizers=OPTIMIZERS,
                       group=GROUP, steps=6, timeout=TIMEOUT, seed=0):
    """add_param_group before step group["step"], with its own options: parameters = the unsharded optimizer's."""
    cases = [make_case(m, o, steps=steps, seed=seed + i, add_group=group) for i, (m, o) in
             enumerate((m, o) for o in optimizers for m in models)]
    for n in world_sizes:
        inputs, results = _run(Optimizer, cases, n, timeout)
        for case, case_inputs, case_results in zip(cases, inputs, results):
            reference = reference_run(case, case_inputs)
            what = _what(case) + f", {group['names']} added before step {group['step']}"
            report(what, n, judge_training(case, n, case_results, reference))
            report(what, n, judge_groups(case, n, case_results, reference))
        options = ", ".join(f"{k}={v}" for k, v in group["options"].items())
        check(True, f"param groups at N={n}: {', '.join(group['names'])} added with {options} before step "
                    f"{group['step']}; parameters after {steps} steps = the unsharded optimizer's, param_groups "
                    "lists every group")
