"""Lab 3's verdicts (labs/lab3_sharded_optimizer.ipynb): the four graded parts, judged where no student code runs.

    training         parameters after every step = the unsharded optimizer's, N = 2, 3, 4
    sharded_state    each rank's inner optimizers hold ≤ 1/N of the trainable elements + the largest parameter's,
                     and its optimizer state ≤ 1/N of the unsharded + the largest parameter's; each trainable
                     element in one rank's inner optimizers; every update right on some rank (its owner's)
    synchronisation  a random rank's (not 0) parameters perturbed before a random step: every rank identical,
                     byte for byte, after it and every later step
    param_groups     two groups at construction, add_param_group mid-training with options of its own (shared
                     out), every lr changed in param_groups mid-run, zero_grad(): every update right on its owner

The points follow what the lab teaches (INSTRUCTORS.md says why): sharding (sharded_state, 4) before
synchronisation (2); training (2), which every rank right after every step needs, is what even an unsharded
optimizer earns. sharded_state and param_groups judge each parameter on the rank that updated it, so a forgotten
synchronisation costs synchronisation and training only.

Each world size gets fresh cases: a model drawn from the checker's rng (widths, vocabulary, tied or not, which
parameters are frozen or get no gradient) and an optimizer class with options drawn from a list broader than the
notebook's; every initial value, gradient and perturbation is drawn from os.urandom and sent to the ranks.
Beside the random cases, every grading at every N has fixed ones that separate the usual kinds of solution
(`_state_cases`, `_group_cases`), so a submission earns the same points on every grading. A rank runs the
student's ShardedOptimizer through lab 3's own `run_case` and sends back its parameters after every step as raw
tensors, and what it measured as numbers. The checker runs the unsharded optimizer itself (`lab3.reference_run`)
and judges with lab 3's judges.

The state bytes, the elements the inner optimizers hold, whether the class is a torch.optim.Optimizer (and not
torch's ZeroRedundancyOptimizer, which the lab asks students to write), the gradients left after zero_grad() and
the sizes of its param_groups are measured inside the rank processes, which also run the student's code: they
are advisory against deliberate tampering (NOTE says so in every feedback). Parameters are values: judged in the
checker.
"""
from __future__ import annotations

import torch

from utils.labchecks import lab3

from utils.tools.grade.verdicts import Case, OnRanks, function, unpredictable_integers

WORLD_SIZES = (2, 3, 4)
# The lab's own time limits (the grader's options override them; a notebook's "grading" metadata too). The
# reference's verdicts take ~11 s and its feedback run ~15 s on 2 cores, the slowest verdict step (training) 7.2 s:
# a verdict step gets 40 s (about 5× that), a cell 60 s (the lab's own deadlock report comes after
# check_timeout = 30 s), each of the two runs 240 s. An endless loop costs about a minute.
LIMITS = {"timeout": 240, "cell_timeout": 60, "verdict_timeout": 40}
NOTE = ("Optimizer-state bytes, the elements your inner optimizers hold, whether your class is a "
        "torch.optim.Optimizer (and not torch's ZeroRedundancyOptimizer), the gradients zero_grad() leaves and the "
        "sizes of its param_groups are measured inside your own rank processes (which also run your code): they "
        "catch mistakes, and are advisory against deliberate tampering.")
OPTIMIZERS = [("AdamW", dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
              ("SGD", dict(lr=5e-2, momentum=0.9)),
              ("Adam", dict(lr=3e-3, betas=(0.8, 0.99))),
              ("SGD", dict(lr=2e-2, momentum=0.5, nesterov=True)),
              ("RMSprop", dict(lr=1e-3, alpha=0.9)),
              ("Adagrad", dict(lr=1e-2))]
SCALE = 2**20


# ------------------------------------------------------------------ on every rank (trusted code, untrusted process)

def run_optimizer(namespace, params, inputs):
    """The student's ShardedOptimizer on this rank (lab 3's run_case, on the CPU); parameters after each step."""
    Optimizer = function(namespace, "ShardedOptimizer")
    case = params
    result = lab3.run_case(Optimizer, case, lab3.unpack_inputs(case, inputs), device=torch.device("cpu"))
    names = lab3.names(case["model"])   # one float32 row per step: every parameter flattened, in name order
    outputs = [torch.stack([torch.cat([step[name].reshape(-1).float() for name in names])
                            for step in result["params"]])]
    measured = {"state_bytes": int(result["state_bytes"]), "held": int(result["held"]),
                "zero_redundancy": int(bool(result["zero_redundancy"])), "grads_left": int(result["grads_left"]),
                "is_optimizer": int(bool(result["is_optimizer"])), "groups": len(result["group_sizes"])}
    measured.update({f"group {i}": int(size) for i, size in enumerate(result["group_sizes"])})
    return outputs, measured


# ------------------------------------------------------------------ in the checker: cases

def _draw(shape):
    """Values spread over [-1, 1] from os.urandom, as float32."""
    count = int(torch.Size(shape).numel())
    return (unpredictable_integers(count, -SCALE, SCALE).to(torch.float32) / SCALE).reshape(shape)


def _model(rng, name):
    """A random model: 2 to 4 layers of random widths, maybe tied, maybe frozen and unused parameters."""
    widths = [rng.choice([8, 16, 24, 32, 40, 48, 64]) for _ in range(rng.randint(3, 5))]
    spec = dict(name=name, vocab=rng.randint(8, 24), widths=widths, tied=rng.random() < 0.5)
    if spec["tied"]:
        widths[-1] = widths[0]   # the head's weight is the embedding's: vocabulary × embedding width
    candidates = [n for n in lab3.names(spec) if n != "wte.weight"]
    picked = rng.sample(candidates, 2)
    if rng.random() < 0.7:
        spec["frozen"] = [picked[0]]
    if rng.random() < 0.7:
        spec["unused"] = [picked[1]]
    return spec


def _case(n, rng, label, steps, perturb=False, add_group=False, optimizer=None, spec=None, groups=False,
          change=None):
    """One case at world size n: a random model (or `spec`), its inputs from os.urandom. add_group (True: a
    random parameter or two, or dict(names, step, options)) added mid-run, and every lr changed in param_groups
    at another step (`change`, else random), with zero_grad() after every step; groups: built with two groups
    (matrices with weight decay, vectors without)."""
    spec = spec or _model(rng, label)
    name, options = optimizer or rng.choice(OPTIMIZERS)
    group = add_group if isinstance(add_group, dict) else None
    if add_group and not group:
        trained = lab3.gradient_names(spec)
        group = dict(names=rng.sample(trained, rng.randint(1, 2)), step=rng.randint(1, steps - 2),
                     options=dict(lr=options["lr"] * rng.choice([0.5, 2.0, 3.0])))
    if add_group and not change:
        change = dict(step=rng.choice([s for s in range(1, steps) if s != group["step"]]),
                      factor=rng.choice([0.1, 0.5, 2.0]))
    case = lab3.make_case(spec, (name, options), steps=steps, seed=0,
                          perturb=dict(step=rng.randint(1, steps - 2), rank=rng.randrange(1, n)) if perturb else None,
                          add_group=group, lr_change=change, zero_grad=add_group,
                          groups=lab3.decay_groups(spec, leave_out=group["names"] if group else ()) if groups else None)
    case = {**case, "options": {k: list(v) if isinstance(v, tuple) else v for k, v in case["options"].items()}}
    inputs = lab3.make_inputs(case, _draw)
    packed = lab3.pack_inputs(case, inputs)
    label = (f"model '{spec['name']}'" if spec["name"] in FIXED else f"model of widths {spec['widths']}") + \
        (", tied" if spec.get("tied") else "") + f", {lab3.describe_optimizer(case)}"
    if perturb:
        label += (f", rank {case['perturb']['rank']}'s parameters perturbed before step {case['perturb']['step']} "
                  f"(steps 0–{steps - 1})")
    if groups:
        label += ", built with 2 groups (weight decay on matrices only)"
    if add_group:
        label += (f", {group['names']} added before step {group['step']}, every lr × {change['factor']:g} before "
                  f"step {change['step']}, zero_grad() after every step")
    return Case(label, case, [[t.clone() for t in packed] for _ in range(n)],
                {"inputs": inputs, "reference": lab3.reference_run(case, inputs)})


# Fixed models in every grading, at every N (their values are still drawn fresh): lab 3's UNEVEN, on which a split
# by position breaks the size bound at N = 2, 3 and 4; DEEP, many similar-sized tensors; PLAIN, for param groups.
FIXED = {lab3.UNEVEN["name"], lab3.DEEP["name"], lab3.PLAIN["name"]}


def _training_cases(n, rng):
    return [_case(n, rng, f"random {i}", steps=10, optimizer=optimizer)
            for i, optimizer in enumerate([OPTIMIZERS[0], OPTIMIZERS[1], rng.choice(OPTIMIZERS[2:])])]


def _state_cases(n, rng):
    # Whatever is drawn, every grading has the UNEVEN model (an index split fails it) and an Adagrad case (the one
    # optimizer here that creates state for parameters without a gradient); what the inner optimizers hold is
    # judged in every case, so an inner optimizer over every parameter fails each one.
    return [_case(n, rng, "uneven", steps=2, optimizer=OPTIMIZERS[0], spec=lab3.UNEVEN),
            _case(n, rng, "deep", steps=2, optimizer=OPTIMIZERS[5], spec=lab3.DEEP),
            _case(n, rng, "random", steps=2, optimizer=rng.choice(OPTIMIZERS))]


def _synchronisation_cases(n, rng):
    return [_case(n, rng, "random", steps=5, perturb=True)]


def _group_cases(n, rng):
    # A fixed case in every grading, the notebook's: two groups at construction, wte.weight added before step 3,
    # every lr halved before step 4, zero_grad() after every step (a group added to every rank's inner optimizer
    # holds wte.weight N times: judge_shared_out); then a random model with a random group, change and steps.
    fixed = _case(n, rng, "plain", steps=6, optimizer=OPTIMIZERS[0], spec=lab3.PLAIN, groups=True,
                  add_group=dict(lab3.GROUP), change=dict(lab3.LR_CHANGE))
    return [fixed, _case(n, rng, "random", steps=6, add_group=True, groups=rng.random() < 0.5)]


# ------------------------------------------------------------------ in the checker: judging

def _rank_results(case, results):
    """lab3.run_case's dicts, rebuilt from what came back (anything but a [steps, elements] tensor: no parameters)."""
    model = lab3.build_model(case.params["model"])
    shapes = {name: p.shape for name, p in model.named_parameters()}
    sizes = [s.numel() for s in shapes.values()]
    steps = case.params["steps"]
    out = []
    for r in results:
        rows = r.value[0] if r.value else None
        params = [{} for _ in range(steps)]
        if isinstance(rows, torch.Tensor) and rows.dtype == torch.float32 and tuple(rows.shape) == (steps, sum(sizes)):
            params = [{name: chunk.reshape(shape) for (name, shape), chunk in zip(shapes.items(), row.split(sizes))}
                      for row in rows]
        groups = [int(r.measured.get(f"group {i}", -1)) for i in range(int(r.measured.get("groups", 0)))]
        out.append(dict(is_optimizer=bool(r.measured.get("is_optimizer", 1)), params=params,
                        state_bytes=r.measured.get("state_bytes", 0), held=r.measured.get("held", 0),
                        zero_redundancy=bool(r.measured.get("zero_redundancy", 0)),
                        grads_left=r.measured.get("grads_left", 0), group_sizes=groups))
    return out


def _judge(kind):
    def judge(n, case, results):
        ranks = _rank_results(case, results)
        reference = case.expected["reference"]
        params = case.params
        if kind == "synchronisation":
            return lab3.judge_synchronisation(params, n, ranks, reference)
        # training judges every rank; sharded_state and param_groups the shard's update (some rank right), so
        # that a forgotten synchronisation costs the parts that need it, not these
        problems = lab3.judge_training(params, n, ranks, reference, anywhere=kind != "training")
        if problems:
            return problems
        if kind == "sharded_state":
            return lab3.judge_state(params, n, ranks, reference)
        if kind == "param_groups":
            return lab3.judge_groups(params, n, ranks, reference)
        return []
    return judge


_WHAT = "ShardedOptimizer"
PARTS = {
    "training": OnRanks(run_optimizer, WORLD_SIZES, _training_cases, _judge("training"), _WHAT,
                        "parameters after each of 10 steps = the unsharded optimizer's on every rank, N = 2, 3, 4, "
                        "random models (tied, frozen, unused parameters), AdamW, SGD and another optimizer, fresh "
                        "random values"),
    "sharded_state": OnRanks(run_optimizer, WORLD_SIZES, _state_cases, _judge("sharded_state"), _WHAT,
                             "each rank's inner optimizers hold at most 1/N of the trainable elements plus the "
                             "largest parameter's (frozen ones are no load), each trainable element on one rank, "
                             "and its optimizer state at most 1/N of the unsharded plus the largest parameter's; "
                             "every update right on the rank that owns it; N = 2, 3, 4, lab 3's uneven and deep "
                             "(a large frozen embedding) models (AdamW, Adagrad) and a random one"),
    "synchronisation": OnRanks(run_optimizer, WORLD_SIZES, _synchronisation_cases, _judge("synchronisation"), _WHAT,
                               "a rank perturbed before a step holds every other rank's parameters, byte for byte, "
                               "after it and after every later step, N = 2, 3, 4; a random model and optimizer, "
                               "the rank (not 0) and the step (1 to 3 of steps 0–4) drawn at random"),
    "param_groups": OnRanks(run_optimizer, WORLD_SIZES, _group_cases, _judge("param_groups"), _WHAT,
                            "two groups at construction, add_param_group mid-training with its own learning rate "
                            "(shared out: each trainable element in one rank's inner optimizers), every lr changed "
                            "in param_groups mid-run, zero_grad() after every step: every update right on the rank "
                            "that owns it, param_groups lists every group, zero_grad() clears every gradient, "
                            "N = 2, 3, 4"),
}
