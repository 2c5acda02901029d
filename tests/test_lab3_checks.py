"""utils.labchecks.lab3: the reference sharded optimizer passes; wrong ones fail with a useful message.

The reference is read from labs/lab3_sharded_optimizer.ipynb (its import cell and its solution cell), so the
lab and these tests cannot drift apart. Each wrong optimizer below has one typical mistake.
"""
import sys
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

from utils.labchecks import lab3
from labtesting import fails as _fails, lab_class

# Ship this module's classes by value, exactly as classes defined in a notebook cell travel.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
FLAT = Path(__file__).resolve().parent / "fixtures" / "lab3_submissions.py"


def _lab_class(student=False):
    return lab_class("lab3_sharded_optimizer", "ShardedOptimizer", student)


# ------------------------------------------------------------------ wrong optimizers

class FullState(torch.optim.Optimizer):
    """Every rank runs the whole optimizer: right parameters, no communication, N copies of the state."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.inner = None
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = dict(self.param_groups[-1])
        if self.inner is None:
            self.inner = self.optimizer_cls([group], **self.kwargs)
        else:
            self.inner.add_param_group(group)

    @torch.no_grad()
    def step(self, closure=None):
        self.inner.step()


class InnerInAList(FullState):
    """The inner optimizer kept inside a list of tuples: the state check must still find it."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.kept, self.inner = [("inner", self.inner)], None

    @torch.no_grad()
    def step(self, closure=None):
        self.kept[0][1].step()


class Sharded(torch.optim.Optimizer):
    """Whole parameters round-robin (by position: unbalanced on some models); `sync` says how the updates reach
    the other ranks; `follow_options`: copy each group's options (a scheduler's lr) into the inner groups;
    `bare_list`: build the inner optimizer on the first group's list of parameters, not on a list of groups."""
    sync = "broadcast"
    follow_options = True
    split = "index"
    bare_list = False

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.kwargs, self.owner, self.inner = optimizer_cls, kwargs, {}, None
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if self.split == "index":
            for p in group["params"]:
                self.owner[p] = len(self.owner) % self.n
        else:   # largest first, to the rank with the fewest trainable elements so far
            loads = [sum(q.numel() for q, r in self.owner.items() if r == rank and q.requires_grad)
                     for rank in range(self.n)]
            for p in sorted(group["params"], key=lambda p: -p.numel()):
                self.owner[p] = min(range(self.n), key=loads.__getitem__)
                loads[self.owner[p]] += p.numel() if p.requires_grad else 0
        mine = {**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]}
        if self.inner is None and self.bare_list:   # optimizer_cls([]) raises where this rank owns none of it
            self.inner = self.optimizer_cls(mine["params"], **{k: v for k, v in mine.items() if k != "params"})
        elif self.inner is None:
            self.inner = self.optimizer_cls([mine], **self.kwargs)
        else:
            self.inner.add_param_group(mine)

    @torch.no_grad()
    def step(self, closure=None):
        if self.follow_options:
            for group, inner in zip(self.param_groups, self.inner.param_groups):
                inner.update({k: v for k, v in group.items() if k != "params"})
        self.inner.step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.sync == "broadcast":
                    dist.broadcast(p, src=self.owner[p])
                elif self.sync == "average":   # the mean of the owner's new value and everyone's old one
                    dist.all_reduce(p)
                    p.div_(self.n)


class NoSync(Sharded):
    sync = None


class BySize(Sharded):
    split = "size"


class IgnoresLearningRateChanges(BySize):
    """Builds the inner groups with the options given at construction and never looks at param_groups again."""
    follow_options = False


class ClearsItsShardOnly(BySize):
    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


class AveragesParameters(Sharded):
    sync = "average"


class CountsFrozenLoad(BySize):
    """Largest first to the least loaded rank, counting frozen elements as load (ZeroRedundancyOptimizer's
    partitioner does): the rank that gets a large frozen tensor gets too few trainable ones."""

    def add_param_group(self, param_group):
        frozen = [p for p in (param_group["params"] if isinstance(param_group, dict) else param_group)
                  if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)          # counted like any other while the split is made
        try:
            super().add_param_group(param_group)
        finally:
            for p in frozen:
                p.requires_grad_(False)


class AddedGroupsEverywhere(BySize):
    """Shards the groups given at construction; a group added later goes to every rank's inner optimizer."""
    built = False

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.built = True

    def add_param_group(self, param_group):
        if not self.built:
            return super().add_param_group(param_group)
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            self.owner[p] = 0               # every rank updates it; rank 0's value is sent
        self.inner.add_param_group(dict(group))


# ------------------------------------------------------------------ the reference passes, stubs are named

def test_reference_passes_every_check(capsys):
    Reference = _lab_class()
    lab3.check_training(Reference)
    lab3.check_sharded_state(Reference)
    lab3.check_synchronisation(Reference)
    lab3.check_param_groups(Reference)
    out = capsys.readouterr().out
    assert out.count("✓") == 8, out


def test_round_robin_sharding_is_correct():
    lab3.check_training(Sharded, world_sizes=(3,), models=(lab3.FROZEN,))
    lab3.check_synchronisation(Sharded, world_sizes=(2,))
    lab3.check_param_groups(Sharded, world_sizes=(2,), models=(lab3.TIED,), optimizers=(lab3.SGD,))


def test_stubs_say_not_implemented():
    Student = _lab_class(student=True)
    for check in (lab3.check_training, lab3.check_sharded_state, lab3.check_synchronisation,
                  lab3.check_param_groups):
        _fails(r"your ShardedOptimizer is not implemented yet: it raised NotImplementedError", check, Student,
               world_sizes=(2,))


# ------------------------------------------------------------------ wrong optimizers

def test_full_state_passes_training_but_not_the_state_check():
    lab3.check_training(FullState, world_sizes=(2,), models=(lab3.PLAIN,))
    _fails(r"rank 0: the optimizers your class keeps hold all 4,176 trainable elements in their param_groups \(at "
           r"most 3,624 allowed: 1/2 \+ the largest parameter's 1,536\)",
           lab3.check_sharded_state, FullState, world_sizes=(2,), models=(lab3.PLAIN,), optimizers=(lab3.ADAMW,))


def test_state_found_inside_containers():
    _fails(r"rank 0: the optimizers your class keeps hold all", lab3.check_sharded_state, InnerInAList,
           world_sizes=(2,), models=(lab3.PLAIN,), optimizers=(lab3.ADAMW,))


class StateOutsideTheInner(BySize):
    """A balanced inner optimizer, plus a copy of every parameter kept in the outer optimizer's own state."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["copy"] = p.detach().clone()


def test_state_kept_beside_the_inner_optimizer_counts():
    _fails(r"rank 0: holds [\d,]+ bytes of optimizer state.* Keep optimizer state only in the inner optimizer",
           lab3.check_sharded_state, StateOutsideTheInner, world_sizes=(2,), models=(lab3.DEEP,),
           optimizers=(lab3.SGD,))


def test_a_split_by_position_is_unbalanced_at_every_world_size():
    # lab3.UNEVEN: equal large tensors 6 positions apart; DEEP: many equal ones, an index split balanced at N = 3.
    for n in (2, 3, 4):
        _fails(r"the split is unbalanced: this rank's inner optimizer holds .* balance by trainable size instead, e\.g\. take "
               r"the parameters largest first", lab3.check_sharded_state, Sharded, world_sizes=(n,),
               models=(lab3.UNEVEN,), optimizers=(lab3.SGD,))
    lab3.check_sharded_state(BySize, world_sizes=(2, 3, 4), optimizers=(lab3.SGD,))


class NoneForTheOthers(torch.optim.Optimizer):
    """One inner optimizer over every parameter; before its step the gradients of the parameters another rank owns
    are set to None, so it creates state for this rank's only (except Adagrad, which creates it for all)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.kwargs, self.owner, self.loads, self.inner = optimizer_cls, kwargs, {}, None, None
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self.loads = self.loads or [0] * self.n
        for p in sorted(group["params"], key=lambda p: -p.numel()):
            self.owner[p] = min(range(self.n), key=self.loads.__getitem__)
            self.loads[self.owner[p]] += p.numel()
        if self.inner is None:
            self.inner = self.optimizer_cls([dict(group)], **self.kwargs)
        else:
            self.inner.add_param_group(dict(group))

    @torch.no_grad()
    def step(self, closure=None):
        had = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in had:
            if self.owner[p] != self.rank:
                p.grad = None
        self.inner.step()
        for p in had:
            dist.broadcast(p, src=self.owner[p])


def test_an_inner_optimizer_over_every_parameter_fails_whatever_state_it_creates():
    lab3.check_training(NoneForTheOthers, world_sizes=(2,), models=(lab3.FROZEN,), optimizers=(lab3.ADAMW,))
    _fails(r"hold all 16,896 trainable elements.*even if it creates state only for the parameters you leave a "
           r"gradient", lab3.check_sharded_state, NoneForTheOthers, world_sizes=(2,), models=(lab3.DEEP,),
           optimizers=(lab3.ADAMW,))


def test_full_state_without_communication_misses_the_perturbation():
    _fails(r"rank 3 \(the perturbed rank\), step 2, wte\.weight: differs from rank 0's after the step .*"
           r"Rank 3's parameters were perturbed before step 2",
           lab3.check_synchronisation, FullState, world_sizes=(4,))


def test_skipping_the_synchronisation_leaves_parameters_not_updated():
    _fails(r"rank 1, step 0, wte\.weight: not updated in this step \(it still holds its value from before step 0\)",
           lab3.check_training, NoSync, world_sizes=(2,), models=(lab3.PLAIN,), optimizers=(lab3.SGD,))


class ZeroForMissingGradients(Sharded):
    """Treats a missing gradient as zero: AdamW's weight decay and momentum still move the parameter."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
        super().step()


def test_parameters_without_gradients_must_not_change():
    _fails(r"step 0, layers\.2\.weight \(no gradient\): changed in step 0, which leaves it unchanged",
           lab3.check_training, ZeroForMissingGradients, world_sizes=(2,), models=(lab3.FROZEN,),
           optimizers=(lab3.ADAMW,))


def test_averaging_parameters_instead_of_sending_the_owners():
    _fails(r"rank 0, step 0, wte\.weight: max \|diff\| .* expected .*, got ",
           lab3.check_training, AveragesParameters, world_sizes=(2,), models=(lab3.PLAIN,),
           optimizers=(lab3.ADAMW,))


def test_judges_are_pure_functions_of_plain_data():
    case = lab3.make_case(lab3.TIED, lab3.SGD, steps=2, perturb=dict(step=1, rank=1))
    inputs = lab3.make_inputs(case)
    assert all(torch.equal(a, b) for a, b in zip(lab3.pack_inputs(case, lab3.unpack_inputs(
        case, lab3.pack_inputs(case, inputs))), lab3.pack_inputs(case, inputs)))
    reference = lab3.reference_run(case, inputs)
    fine = dict(is_optimizer=True, params=reference["params"], state_bytes=0, held=0, group_sizes=[4])
    assert lab3.judge_training(case, 2, [fine, fine], reference) == []
    assert lab3.judge_synchronisation(case, 2, [fine, fine], reference) == []
    stale = {**fine, "params": [reference["init"], reference["params"][1]]}
    assert "not updated" in lab3.judge_training(case, 2, [fine, stale], reference)[0]
    total, largest = reference["state_bytes"], reference["largest"]
    ranks = lambda *nbytes, held=0: [dict(fine, state_bytes=b, held=held) for b in nbytes]  # noqa: E731
    assert lab3.judge_state(case, 2, ranks(total // 2, total - total // 2), reference) == []
    assert "all of it" in lab3.judge_state(case, 2, ranks(total, total), reference)[0]
    assert "far less than the unsharded" in lab3.judge_state(case, 2, ranks(0, 0), reference)[0]
    assert "hold all" in lab3.judge_state(case, 2, ranks(total // 2, total // 2, held=reference["trainable"]),
                                          reference)[0]
    assert lab3.state_bound(reference, 2) == total / 2 + largest


def test_frozen_parameters_state_is_not_counted():
    # Adagrad builds state for every parameter it is given, frozen ones included (torch 2.13): counting it made
    # the reference fail the state bound in ~2 % of gradings (7 of 300 simulated Adagrad cases). The model's
    # frozen parameters are told by identity: a tensor of the student's own that does not require grad (a flat
    # shard, a plain view of a buffer) is state like any other.
    trainable, frozen = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(1000), requires_grad=False)
    model = torch.nn.ParameterList([trainable, frozen])
    optimizer = torch.optim.Adagrad([trainable, frozen], lr=0.1)
    assert len(optimizer.state) == 2
    assert lab3.state_bytes(optimizer, model) == 10 * 4 + 4   # the trainable parameter's sum and its step counter
    shard = torch.zeros(2, 8).view(2, -1)[1]                   # a plain view: a leaf without requires_grad
    optimizer = torch.optim.Adagrad([shard], lr=0.1)
    assert lab3.state_bytes(optimizer, model) == 8 * 4 + 4


class KeepsItsShardInAnObject(BySize):
    """The inner optimizer kept inside an object of the student's own, not in a container."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.box = type("Box", (), {})()
        self.box.optimizer, self.inner = self.inner, None

    def add_param_group(self, param_group):
        if getattr(self, "box", None) is not None:
            self.inner = self.box.optimizer
        super().add_param_group(param_group)
        if getattr(self, "box", None) is not None:
            self.inner = None

    @torch.no_grad()
    def step(self, closure=None):
        self.inner = self.box.optimizer
        super().step()
        self.inner = None


def test_correct_designs_of_other_structures_pass():
    """Flat shards held as plain views (tests/fixtures/lab3_submissions.py: its state was read as 0 bytes, since it
    does not require grad), and an inner optimizer kept inside an object of the student's own."""
    namespace = {"__name__": "lab3_submissions"}
    exec(compile(FLAT.read_text(), str(FLAT), "exec"), namespace)
    for Optimizer in (namespace["ShardedOptimizer"], KeepsItsShardInAnObject):
        lab3.check_sharded_state(Optimizer, world_sizes=(2,), models=(lab3.DEEP,), optimizers=(lab3.ADAMW,))


def test_a_split_that_counts_frozen_load_is_unbalanced():
    _fails(r"the split is unbalanced: this rank's inner optimizer holds 16,896 of the 16,896 trainable elements.*"
           r"counts frozen parameters as load", lab3.check_sharded_state, CountsFrozenLoad, world_sizes=(2,),
           models=(lab3.DEEP,), optimizers=(lab3.SGD,))


def test_a_group_added_to_every_rank_is_not_shared_out():
    _fails(r"the ranks' inner optimizers hold [\d,]+ trainable elements together, 512 more than the model's .*"
           r"The parameters added with add_param_group \(wte\.weight\) must be shared out too",
           lab3.check_param_groups, AddedGroupsEverywhere, world_sizes=(2,), models=(lab3.PLAIN,),
           optimizers=(lab3.ADAMW,))


def test_a_sharded_optimizer_without_synchronisation_keeps_the_sharding_points():
    """Part 2 judges each parameter on its owner: a forgotten broadcast costs parts 1 and 3, not part 2."""
    lab3.check_sharded_state(type("NoSyncBySize", (BySize,), {"sync": None}), world_sizes=(2,), models=(lab3.UNEVEN,),
                             optimizers=(lab3.SGD,))


def test_a_learning_rate_changed_in_param_groups_must_reach_the_inner_optimizer():
    lab3.check_training(IgnoresLearningRateChanges, world_sizes=(2,), models=(lab3.PLAIN,), optimizers=(lab3.SGD,))
    _fails(r"every group's lr was multiplied by 0\.5 in optimizer\.param_groups before step 4 .* copy every "
           r"group's options", lab3.check_param_groups, IgnoresLearningRateChanges, world_sizes=(2,),
           models=(lab3.PLAIN,), optimizers=(lab3.SGD,))


def test_groups_at_construction_keep_their_options():
    # decay groups: AdamW's weight decay on matrices only; an inner optimizer built from the options given to
    # the constructor (not each group's) decays the biases too
    class OneOptionSet(BySize):
        def add_param_group(self, param_group):
            super().add_param_group(param_group)
            for inner in self.inner.param_groups:
                inner.update(self.kwargs)
        follow_options = False
    _fails(r"layers\.0\.bias", lab3.check_param_groups, OneOptionSet, world_sizes=(2,), models=(lab3.PLAIN,),
           optimizers=(lab3.ADAMW,))


class BareList(BySize):
    bare_list = True


def test_a_rank_that_owns_nothing_in_a_group_is_met_by_a_visible_check():
    """Part 4's first group has three matrices: at N = 4 one rank owns none of them, and optimizer_cls([]) raises.
    The visible check meets it (not only the grader), and its message says what to do; part 1's models give
    every rank a parameter, so the same class trains right there."""
    lab3.check_training(BareList, world_sizes=(4,), models=(lab3.PLAIN,), optimizers=(lab3.SGD,), steps=2)
    _fails(r"optimizer got an empty parameter list: a rank may own no parameter of a group .* optimizer_cls\(\[\{",
           lab3.check_param_groups, BareList, world_sizes=(4,), models=(lab3.PLAIN,), optimizers=(lab3.SGD,))


def test_zero_grad_must_clear_every_gradient():
    _fails(r"after optimizer\.zero_grad\(\), \d+ parameters still hold a nonzero \.grad", lab3.check_param_groups,
           ClearsItsShardOnly, world_sizes=(2,), models=(lab3.PLAIN,), optimizers=(lab3.SGD,))


class WrapsTorchs(torch.optim.Optimizer):
    """Keeps torch's own ZeroRedundancyOptimizer inside: right values, state sharded, and not allowed."""

    def __init__(self, params, optimizer_cls, **kwargs):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        super().__init__(params, kwargs)
        self.inner = ZeroRedundancyOptimizer([p for g in self.param_groups for p in g["params"]], optimizer_cls,
                                             **kwargs)

    def step(self, closure=None):
        self.inner.step()


def test_zero_redundancy_optimizer_is_not_allowed():
    _fails(r"is, or keeps, torch\.distributed\.optim\.ZeroRedundancyOptimizer: this lab asks you to write what it "
           r"does", lab3.check_training, WrapsTorchs, world_sizes=(2,), models=(lab3.PLAIN,), optimizers=(lab3.SGD,))


# ------------------------------------------------------------------ reviewers' leftovers

class NewGroupNeverReachesTheInner(Sharded):
    """add_param_group keeps the new group in param_groups only: no rank's inner optimizer ever sees it."""

    def add_param_group(self, param_group):
        if self.inner is None:
            return super().add_param_group(param_group)
        torch.optim.Optimizer.add_param_group(self, param_group)
        for p in self.param_groups[-1]["params"]:
            self.owner[p] = len(self.owner) % self.n


def test_a_parameter_no_rank_updated_points_at_the_inner_optimizer():
    _fails(r"wte\.weight.*: not updated in this step on any rank .*add_param_group must reach the inner optimizer",
           lab3.check_param_groups, NewGroupNeverReachesTheInner, world_sizes=(2,), models=(lab3.PLAIN,),
           optimizers=(lab3.SGD,))


def test_one_owner_not_updating_keeps_the_synchronisation_message():
    message = _fails(r"not updated in this step \(it still holds", lab3.check_training, NoSync, world_sizes=(2,),
                     models=(lab3.PLAIN,), optimizers=(lab3.SGD,))
    assert "on any rank" not in message


class WaitsForever(Sharded):
    """Every rank waits for a message no rank sends: a hang, whatever its cause (the message names lab 3's)."""

    @torch.no_grad()
    def step(self, closure=None):
        dist.recv(torch.zeros(1), src=(self.rank + 1) % self.n)


def test_a_hang_names_lab_3s_usual_causes():
    message = _fails(r"likely a deadlock.*a dist\.broadcast of a parameter that only its owner calls",
                     lab3.check_training, WaitsForever, world_sizes=(2,), models=(lab3.PLAIN,),
                     optimizers=(lab3.SGD,), steps=1, timeout=8)
    assert "dist.send before its dist.recv" not in message          # lab 1's hint stays lab 1's


def test_a_tied_model_needs_equal_embedding_and_head_widths():
    lab3.build_model(lab3.TIED)
    try:
        lab3.build_model(dict(lab3.TIED, widths=[32, 48, 40]))
    except ValueError as err:
        assert "widths [32, 48, 40]" in str(err)
    else:
        raise AssertionError("a tie of a 32-wide embedding with a 40-wide head was accepted")
