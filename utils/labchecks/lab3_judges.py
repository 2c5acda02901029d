"""Lab 3's judges: pure functions of (case, world size, the ranks' plain data, the reference) that return a list
of problems, each a line a student can act on (empty: passed). lab3.py re-exports them; a grader calls them in a
process that runs no student code.
"""
from __future__ import annotations

import torch

from .harness import fmt
from .lab3_cases import label

RTOL, ATOL = 1e-5, 1e-7   # the same elementwise update in another layout agrees to round-off
SEEN_SHARE = 0.9          # the ranks' state together: at least this share of the unsharded (fewer step counters
                          # in a flat layout hold a little less; state kept out of sight, nothing)


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


def _not_allowed(results):
    """A class that is no torch.optim.Optimizer, or that is or keeps torch's ZeroRedundancyOptimizer: no part passes."""
    for rank, r in enumerate(results):
        if not r["is_optimizer"]:
            return [f"rank {rank}: ShardedOptimizer(...) is not a torch.optim.Optimizer: subclass it and call "
                    "super().__init__(params, defaults)"]
        if r.get("zero_redundancy"):
            return [f"rank {rank}: your optimizer is, or keeps, torch.distributed.optim.ZeroRedundancyOptimizer: "
                    "this lab asks you to write what it does, so no part passes with it. Split the parameters "
                    "yourself and build a plain optimizer_cls on this rank's share"]
    return []


def judge_training(case, world_size, results, reference, steps=None, anywhere=False):
    """Problems with the parameters after each step (all steps, or the first `steps`), rank by rank.

    anywhere: a parameter passes when SOME rank holds the right value (its owner's update is right), so a part
    that judges the shard's update (sharded state, param groups) does not also judge the synchronisation.
    Stops at the first step with a wrong parameter (later steps start from wrong values).
    """
    problems = _not_allowed(results)
    if problems:
        return problems
    spec = case["model"]
    for step in range(case["steps"] if steps is None else steps):
        want_step = reference["params"][step]
        before = reference["params"][step - 1] if step else reference["init"]
        stale = {name for name in want_step if all(
            isinstance(r["params"][step].get(name), torch.Tensor) and torch.equal(r["params"][step][name], before[name])
            for r in results)}   # no rank holds a new value
        right = {name for name, want in want_step.items() if anywhere and any(
            isinstance(r["params"][step].get(name), torch.Tensor) and close(r["params"][step][name], want)
            for r in results)}
        for rank, r in enumerate(results):
            for name, want in want_step.items():
                got = r["params"][step].get(name)
                if name in right or (got is not None and close(got, want)):
                    continue
                problems.append(f"rank {rank}, step {step}, {label(spec, name)}: "
                                f"{_diagnose(got, want, before[name], step, nobody=name in stale)}")
        change = case.get("lr_change")
        if problems and change and step == change["step"]:
            problems.insert(0, f"every group's lr was multiplied by {change['factor']:g} in optimizer.param_groups "
                               f"before step {step} (as a learning-rate scheduler does), and the first wrong "
                               "parameters come in that step: before each step, copy every group's options (lr, "
                               "weight_decay, ...) from self.param_groups into the inner optimizer's groups")
        if problems:
            return problems
    return problems


def state_bound(reference, world_size):
    """At most 1/N of the unsharded optimizer's state plus the state of its largest parameter."""
    return reference["state_bytes"] / world_size + reference["largest"]


def held_bound(reference, world_size):
    """At most 1/N of the trainable elements plus the largest trainable parameter's, in the inner optimizers."""
    return reference["trainable"] / world_size + reference["largest_elements"]


def _held_problem(rank, held, world_size, reference, together):
    """What is wrong with one rank holding `held` trainable elements (`together`: all ranks' sum)."""
    total, bound = reference["trainable"], held_bound(reference, world_size)
    if held >= total and together > total + world_size * reference["parameters"]:
        return (f"rank {rank}: the optimizers your class keeps hold all {total:,} trainable elements in their "
                f"param_groups (at most {bound:,.0f} allowed: 1/{world_size} + the largest parameter's "
                f"{reference['largest_elements']:,}). An inner optimizer over every parameter is not sharded, even "
                "if it creates state only for the parameters you leave a gradient: build the inner optimizer on "
                "this rank's shard only")
    return (f"rank {rank}: the split is unbalanced: this rank's inner optimizer holds {held:,} of the {total:,} "
            f"trainable elements ({held / total:.0%}), more than 1/{world_size} ({total / world_size:,.0f}) + the "
            f"largest parameter ({reference['largest_elements']:,}) = {bound:,.0f}. A split by position "
            "(parameter i to rank i mod N) gives tensors N positions apart to one rank, and a split that counts "
            "frozen parameters as load gives a rank with a large frozen tensor too few trainable ones: balance by "
            "trainable size instead, e.g. take the parameters largest first and give each to the rank with the "
            "fewest trainable elements so far (a frozen parameter is no load; every rank computing the same split)")


def judge_state(case, world_size, results, reference):
    """Problems with what each rank's optimizers hold: the elements of its inner optimizers' parameters
    (`held`) and the bytes of its optimizer state (`state_bytes`), one rank dict each."""
    together = sum(r["held"] for r in results)
    problems = [_held_problem(rank, r["held"], world_size, reference, together) for rank, r in enumerate(results)
                if r["held"] > held_bound(reference, world_size)] or judge_shared_out(case, world_size, results,
                                                                                       reference)
    if problems:
        return problems
    bound, total = state_bound(reference, world_size), reference["state_bytes"]
    held = [r["state_bytes"] for r in results]
    for rank, nbytes in enumerate(held):
        if nbytes > bound:
            where = ("all of it: every rank keeps state for every parameter" if nbytes >= total else
                     "more than the parameters its inner optimizer holds have")
            problems.append(f"rank {rank}: holds {nbytes:,} bytes of optimizer state, at most {bound:,.0f} allowed "
                            f"(1/{world_size} of the unsharded {total:,} + {reference['largest']:,} for the "
                            f"largest parameter) — {where}. Keep optimizer state only in the inner optimizer "
                            "built on this rank's shard (not in your class's own self.state)")
    if not problems and sum(held) < SEEN_SHARE * total:
        problems.append(f"the ranks hold {sum(held):,} bytes of optimizer state together, far less than "
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


def judge_shared_out(case, world_size, results, reference):
    """Problems with parameters held by several ranks' inner optimizers: together the ranks may hold each
    trainable element once (a flat layout's padding aside: up to N − 1 elements per parameter), also after
    add_param_group, whose new group is shared out like the others."""
    held, total = sum(r["held"] for r in results), reference["trainable"]
    slack = world_size * reference["parameters"]
    if held <= total + slack:
        return []
    added = (case.get("add_group") or {}).get("names")
    also = (f" The parameters added with add_param_group ({', '.join(added)}) must be shared out too: give each "
            "to one rank's inner optimizer (every rank makes the same choice), not to every rank's") if added else ""
    return [f"the ranks' inner optimizers hold {held:,} trainable elements together, {held - total:,} more than "
            f"the model's {total:,}: some parameters are in the inner optimizers of several ranks, so their "
            f"state is kept several times.{also} (Per rank: {', '.join(format(r['held'], ',') for r in results)}.)"]


def judge_groups(case, world_size, results, reference):
    """Problems with param_groups: one group per group given (at construction or by add_param_group), each
    trainable element in one rank's inner optimizers only (`judge_shared_out`), and zero_grad() clearing every
    parameter's gradient."""
    want = reference["group_sizes"]
    for rank, r in enumerate(results):
        if r["group_sizes"] != want:
            return [f"rank {rank}: optimizer.param_groups holds groups of {r['group_sizes']} parameters, expected "
                    f"{want}: call super().add_param_group(group) in your add_param_group, so param_groups lists "
                    "every parameter (schedulers and zero_grad() use it)"]
        if r.get("grads_left"):
            return [f"rank {rank}: after optimizer.zero_grad(), {r['grads_left']} parameters still hold a nonzero "
                    ".grad: zero_grad() must clear every parameter's gradient, not only this rank's shard's (the "
                    "base class's zero_grad does, when param_groups lists every parameter)"]
    return judge_shared_out(case, world_size, results, reference)
