"""Lab 3's checks (labs/lab3_sharded_optimizer.ipynb): a sharded optimizer (ZeRO stage 1).

The contract: `ShardedOptimizer(params, optimizer_cls, **kwargs)` is a `torch.optim.Optimizer`; each rank's
inner optimizers hold only its shard of the parameters, balanced by size, and keep state only for it; `step()`
copies each group's options (a scheduler's lr) into the inner groups, updates the shard with
`optimizer_cls(**kwargs)` and synchronises the parameters, so every rank ends the step with the parameters one
unsharded `optimizer_cls` would produce. Gradients arrive already averaged over the ranks (as DDP leaves them);
parameters without a gradient are left alone; several groups at construction, `add_param_group` mid-training and
`zero_grad()` work. torch's own ZeroRedundancyOptimizer is not allowed (no part passes with it).

Each check prints one ✓ line per world size, saying what it verified, or raises a `LabCheckFailure` that says
what to fix (rank, parameter, step, expected vs got):
  check_training(ShardedOptimizer)        parameters after every step = the unsharded optimizer's
  check_sharded_state(ShardedOptimizer)   each rank's inner optimizers hold ≤ 1/N of the trainable elements, and
                                          its state ≤ 1/N of the unsharded, each + the largest parameter's; each
                                          trainable element on one rank; every update right on its owner
  check_synchronisation(ShardedOptimizer) one rank's parameters perturbed before a step: identical again after it
  check_param_groups(ShardedOptimizer)    two groups at construction, add_param_group mid-training with its own
                                          lr (shared out too), every lr changed in param_groups mid-run,
                                          zero_grad(); every update right on its owner

Three layers, so that a grader can judge in a process that runs no student code:
  1. what a rank runs (`run_cases`, student code inside): it returns plain data only (see `run_case`);
  2. the reference (`reference_run`): the unsharded optimizer in one process, from the case and its inputs;
  3. the judges (`judge_training`, `judge_state`, `judge_synchronisation`, `judge_groups`): pure functions of
     (case, world size, the ranks' data, the reference) returning a list of problems (empty: passed).
Cases and their inputs are plain data and tensors (lab3_cases.py), so a grader can draw the inputs where
students cannot predict them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import launching
from ..checks import check
from ..memory import unique_storage_bytes
from .harness import TIMEOUT, report, run_on_ranks
from .lab3_cases import (ADAMW, DEEP, FROZEN, GROUP, LR_CHANGE, MODELS, OPTIMIZERS, PLAIN, SGD, STEPS,  # noqa: F401
                         TIED, UNEVEN, LabModel, build_model, decay_groups, describe_optimizer, gradient_names,
                         label, make_case, make_inputs, names, optimizer_class, options, pack_inputs,
                         unpack_inputs)
from .lab3_judges import (ATOL, RTOL, SEEN_SHARE, close, first_difference, held_bound, judge_groups,  # noqa: F401
                          judge_state, judge_synchronisation, judge_training, state_bound)

WORLD_SIZES = (2, 4)


# ------------------------------------------------------------------ 1. what runs on every rank

def _optimizers_in(value, found, depth=3):
    """Every torch.optim.Optimizer in `value`: itself, or inside lists, tuples, sets and dicts, or an attribute
    of an object of the student's own (a shard object that keeps its optimizer), `depth` deep."""
    if isinstance(value, torch.optim.Optimizer):
        if all(value is not o for o in found):
            found.append(value)
    elif not depth or isinstance(value, (torch.Tensor, torch.nn.Module, type, str, bytes)):
        return found
    elif isinstance(value, (list, tuple, set, frozenset, dict)):
        for item in (value.values() if isinstance(value, dict) else value):
            _optimizers_in(item, found, depth - 1)
    elif isinstance(getattr(value, "__dict__", None), dict):
        for item in vars(value).values():
            _optimizers_in(item, found, depth - 1)
    return found


def _kept_optimizers(optimizer):
    """`optimizer` and every optimizer it keeps as an attribute (directly, or inside lists, tuples and dicts)."""
    optimizers = [optimizer]
    for value in vars(optimizer).values():
        _optimizers_in(value, optimizers)
    return optimizers


def state_bytes(optimizer, model):
    """Bytes of the tensors in `optimizer.state` and in the state of every optimizer it keeps (`_kept_optimizers`):
    what this rank keeps as optimizer state, whatever its keys are (the model's parameters, or tensors of the
    student's own such as flat shards, which need not require grad: torch.optim accepts a leaf that does not)."""
    # The state of the model's frozen parameters (told by identity) does not count, here and in the unsharded
    # reference: some optimizers (Adagrad) create state for every parameter they are given, frozen ones
    # included, which is no sharding question.
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    tensors = [v for o in _kept_optimizers(optimizer) for key, state in getattr(o, "state", {}).items()
               if isinstance(state, dict) and id(key) not in frozen
               for v in state.values() if torch.is_tensor(v)]
    return unique_storage_bytes(tensors)


def held_elements(optimizer, model):
    """Elements of the tensors in the param_groups of the inner optimizers (those `optimizer` keeps as
    attributes; not its own param_groups, which rightly list every parameter): what this rank's inner
    optimizers would keep state for. The model's frozen parameters do not count (they never get state); a
    tensor of the student's own (a flat shard) counts whole."""
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    seen = {}
    for inner in _kept_optimizers(optimizer)[1:]:
        for group in getattr(inner, "param_groups", []):
            for t in group.get("params", []) if isinstance(group, dict) else []:
                if torch.is_tensor(t) and id(t) not in frozen:
                    seen[id(t)] = t.numel()
    return sum(seen.values())


def uses_zero_redundancy(optimizer):
    """Whether the optimizer is, or keeps, torch's own ZeroRedundancyOptimizer (which this lab asks you to write)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return any(isinstance(o, ZeroRedundancyOptimizer) for o in _kept_optimizers(optimizer))


def _construct(Optimizer, case, named):
    """The optimizer as the case builds it: one group of every parameter not added later, or the case's groups."""
    added = (case.get("add_group") or {}).get("names", ())
    if case.get("groups"):
        params = [{"params": [named[n] for n in g["names"]], **options(g["options"])} for g in case["groups"]]
    else:
        params = [p for name, p in named.items() if name not in added]
    if Optimizer is None:
        return optimizer_class(case)(params, **options(case["options"]))
    return Optimizer(params, optimizer_class(case), **options(case["options"]))


def _before_step(optimizer, case, named, step):
    """What the case does to the optimizer before `step`: add a group, change every group's lr."""
    group = case.get("add_group")
    if group and step == group["step"]:
        optimizer.add_param_group({"params": [named[n] for n in group["names"]], **options(group["options"])})
    change = case.get("lr_change")
    if change and step == change["step"]:
        for g in optimizer.param_groups:   # as a learning-rate scheduler does
            g["lr"] = g["lr"] * change["factor"]


EMPTY_LIST = ("a rank may own no parameter of a group (a group of one parameter at N = 2, or of fewer parameters "
              "than ranks: part 4 has both), and torch.optim optimizers refuse an empty list of parameters but "
              "accept a group whose list is empty: build the inner optimizer as optimizer_cls([{**options, "
              "\"params\": mine}], **kwargs) and add later groups with its add_param_group, one inner group per "
              "group even when `mine` is empty (then the groups line up in step())")


@contextlib.contextmanager
def _owns_nothing_explained():
    """torch.optim's ValueError for an empty parameter list, raised again saying what it means here; any other
    error passes as it was."""
    try:
        yield
    except ValueError as error:
        if "empty parameter list" in str(error):
            raise ValueError(f"{error}: {EMPTY_LIST}").with_traceback(error.__traceback__) from error
        raise


def run_case(Optimizer, case, inputs, device=None):
    """Train with the student's optimizer on this rank; return plain data (CPU tensors, numbers).

    Every rank starts from inputs["init"] and gets the same gradients each step (grad None for frozen and
    unused parameters). Returned dict:
      is_optimizer  isinstance(optimizer, torch.optim.Optimizer)
      params        per step {name: tensor} after optimizer.step()
      state_bytes   bytes of optimizer state on this rank after the last step (see `state_bytes`)
      held          elements the inner optimizers hold in their param_groups after the last step (`held_elements`)
      zero_redundancy  whether it is or keeps torch's ZeroRedundancyOptimizer
      grads_left    parameters with a nonzero .grad after optimizer.zero_grad(), not counting those in no group
                    yet (the most over the steps; 0 when the case calls no zero_grad)
      group_sizes   [len(group["params"]) for each of optimizer.param_groups] after the last step
    """
    rank = dist.get_rank()
    device = device or launching.device()
    model = build_model(case["model"]).to(device)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(inputs["init"][name])
    with _owns_nothing_explained():
        optimizer = _construct(Optimizer, case, named)
    params, grads_left = [], 0
    for step in range(case["steps"]):
        with _owns_nothing_explained():
            _before_step(optimizer, case, named, step)
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
        if case.get("zero_grad"):
            optimizer.zero_grad()
            group = case.get("add_group") or {}
            pending = group.get("names", ()) if step < group.get("step", 0) else ()   # in no group yet
            grads_left = max(grads_left, sum(p.grad is not None and bool(p.grad.any())
                                             for name, p in named.items() if name not in pending))
    is_optimizer = isinstance(optimizer, torch.optim.Optimizer)
    return dict(is_optimizer=is_optimizer, params=params, state_bytes=state_bytes(optimizer, model),
                held=held_elements(optimizer, model), zero_redundancy=uses_zero_redundancy(optimizer),
                grads_left=grads_left,
                group_sizes=[len(g["params"]) for g in optimizer.param_groups] if is_optimizer else [])


def run_cases(Optimizer, cases, inputs):
    """run_case for every case, on this rank (the function `run_on_ranks` launches)."""
    return [run_case(Optimizer, case, case_inputs) for case, case_inputs in zip(cases, inputs)]


# ------------------------------------------------------------------ 2. the reference (no student code)

def reference_run(case, inputs):
    """The unsharded optimizer in one process on the same inputs (no perturbation).

    Returns dict(init={name: tensor} before step 0, params=[{name: tensor} per step], state_bytes=total bytes
    of optimizer state after the last step, largest=`largest_state`, trainable and largest_elements (elements
    of the trainable parameters, all and the largest one's), parameters (how many are trainable), group_sizes).
    """
    model = build_model(case["model"])
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(inputs["init"][name])
    optimizer = _construct(None, case, named)
    params = []
    for step in range(case["steps"]):
        _before_step(optimizer, case, named, step)
        for name, p in named.items():
            p.grad = inputs["grads"][step].get(name)
            p.grad = None if p.grad is None else p.grad.clone()
        optimizer.step()
        params.append({name: p.detach().clone() for name, p in named.items()})
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    return dict(init=dict(inputs["init"]), params=params, state_bytes=sum(_per_parameter_state(optimizer)),
                largest=largest_state(case), trainable=sum(trainable), largest_elements=max(trainable, default=0),
                parameters=len(trainable),
                group_sizes=[len(g["params"]) for g in optimizer.param_groups])


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


def check_sharded_state(Optimizer, world_sizes=WORLD_SIZES, models=(DEEP, UNEVEN), optimizers=OPTIMIZERS,
                        steps=2, timeout=TIMEOUT, seed=0):
    """Each rank's inner optimizers hold ≤ 1/N of the trainable elements + the largest parameter's (frozen ones
    are no load), together each trainable element once, and its optimizer state is ≤ 1/N of the unsharded
    optimizer's + the state of its largest parameter; every parameter updated right on the rank that owns it
    (the synchronisation is check_synchronisation's)."""
    cases = [make_case(m, o, steps=steps, seed=seed + i) for i, (m, o) in
             enumerate((m, o) for o in optimizers for m in models)]
    for n in world_sizes:
        inputs, results = _run(Optimizer, cases, n, timeout)
        shares = []
        for case, case_inputs, case_results in zip(cases, inputs, results):
            reference = reference_run(case, case_inputs)
            report(_what(case), n, judge_training(case, n, case_results, reference, anywhere=True))
            report(_what(case) + ", optimizer state", n, judge_state(case, n, case_results, reference))
            held = [r["state_bytes"] for r in case_results]
            rank = max(range(n), key=held.__getitem__)
            shares.append((held[rank] / reference["state_bytes"], rank, case, reference))
        share, rank, case, reference = max(shares, key=lambda s: s[0])
        check(True, f"sharded state at N={n}: every rank's inner optimizers hold at most 1/N of the trainable "
                    "elements plus the largest parameter's, and its optimizer state at most 1/N of the unsharded "
                    f"plus the largest parameter's; your largest share: rank {rank}, "
                    f"{share:.0%} of the state ('{case['model']['name']}', {case['optimizer']}; allowed "
                    f"{state_bound(reference, n) / reference['state_bytes']:.0%} = 1/{n} + "
                    f"{reference['largest'] / reference['state_bytes']:.0%})")


def check_synchronisation(Optimizer, world_sizes=WORLD_SIZES, model=PLAIN, optimizer=ADAMW, steps=4, at_step=2,
                          timeout=TIMEOUT, seed=0):
    """The last rank's parameters are perturbed before step `at_step`: every rank identical after each step."""
    for n in world_sizes:
        case = make_case(model, optimizer, steps=steps, seed=seed, perturb=dict(step=at_step, rank=n - 1))
        inputs, results = _run(Optimizer, [case], n, timeout)
        report(_what(case), n, judge_synchronisation(case, n, results[0], reference_run(case, inputs[0])))
        check(True, f"synchronisation at N={n}: rank {n - 1}'s parameters perturbed before step {at_step}; after "
                    "that step and the next, every rank holds the same parameters, byte for byte (the grader draws "
                    "the rank, not 0, and the step)")


def check_param_groups(Optimizer, world_sizes=WORLD_SIZES, models=(PLAIN, TIED), optimizers=OPTIMIZERS,
                       group=GROUP, lr_change=LR_CHANGE, steps=6, timeout=TIMEOUT, seed=0):
    """Built with two groups (matrices with weight decay, vectors without), a group added before
    group["step"] with options of its own, every lr changed in param_groups before lr_change["step"], and
    zero_grad() after every step: parameters = the unsharded optimizer's, param_groups lists every group,
    zero_grad() clears every gradient."""
    cases = [make_case(m, o, steps=steps, seed=seed + i, add_group=group, lr_change=lr_change, zero_grad=True,
                       groups=decay_groups(m, leave_out=group["names"])) for i, (m, o) in
             enumerate((m, o) for o in optimizers for m in models)]
    for n in world_sizes:
        inputs, results = _run(Optimizer, cases, n, timeout)
        for case, case_inputs, case_results in zip(cases, inputs, results):
            reference = reference_run(case, case_inputs)
            what = _what(case) + f", {group['names']} added before step {group['step']}"
            report(what, n, judge_training(case, n, case_results, reference, anywhere=True))
            report(what, n, judge_groups(case, n, case_results, reference))
        options = ", ".join(f"{k}={v}" for k, v in group["options"].items())
        check(True, f"param groups at N={n}: built with 2 groups (matrices with weight decay, vectors without), "
                    f"{', '.join(group['names'])} added with {options} before step {group['step']}, every lr × "
                    f"{lr_change['factor']:g} in param_groups before step {lr_change['step']}; parameters after "
                    f"{steps} steps = the unsharded optimizer's, param_groups lists every group, zero_grad() "
                    "clears every gradient")
