"""Lab 3's cases as plain data: the models, the optimizers, and the tensors a case runs on.

A case (`make_case`) is a dict that travels as JSON: a model spec, an optimizer name and options, the number of
steps, a seed, and what happens mid-run (a perturbation, a group added with `add_param_group`, a learning rate
changed in `param_groups` as a scheduler does, `zero_grad` after each step). Its inputs (initial parameters,
each step's gradients, a perturbation) are tensors from `make_inputs`, packed in a fixed order for a grader.
lab3.py runs, references and judges the cases.
"""
from __future__ import annotations

import torch

STEPS = 10


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
# Many similar-sized tensors (sixteen 32×32 layers): the largest is 6 % of the state, so "1/N + the largest
# parameter's" is a bound that means something (at N = 4, 31 % of the state). And a large frozen tensor, the
# 1024×32 embedding (tied to the head, so both are frozen), twice the trainable elements: a split that counts
# frozen elements as load (as ZeroRedundancyOptimizer's partitioner does) gives it a rank of its own and the
# trainable parameters to the others, beyond the bound at N = 2, 3 and 4. Balance counts trainable elements.
DEEP = dict(name="deep", vocab=1024, widths=[32] * 17, tied=True, frozen=["wte.weight"], unused=["layers.5.weight"])
# Eight 32×32 weights among small 32×4 and 4×32 ones, every third layer: 6 positions apart in named_parameters(),
# so a split by position (parameter i to rank i mod N) gives them all to one rank at N = 2 and 3, to two at N = 4.
UNEVEN = dict(name="wide every third layer", vocab=16, widths=[32, 32, 4] * 8 + [32])
FROZEN = dict(name="frozen and unused", vocab=16, widths=[32, 48, 48, 32],
              frozen=["layers.0.weight", "layers.1.bias"], unused=["layers.2.weight", "layers.2.bias"])
TIED = dict(name="tied", vocab=16, widths=[32, 48, 32], tied=True)
MODELS = (PLAIN, FROZEN, TIED)
ADAMW = ("AdamW", dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))
SGD = ("SGD", dict(lr=5e-2, momentum=0.9))
OPTIMIZERS = (ADAMW, SGD)
GROUP = dict(names=["wte.weight"], options=dict(lr=2e-2), step=3)   # added before step 3 with its own lr
LR_CHANGE = dict(step=4, factor=0.5)   # every group's lr halved before step 4, in param_groups (as a scheduler)


def make_case(model, optimizer, steps=STEPS, seed=0, perturb=None, add_group=None, groups=None, lr_change=None,
              zero_grad=False):
    """One case, as plain data. perturb: dict(step, rank); add_group: dict(names, options, step); groups: the
    parameter groups at construction, [dict(names, options), ...] (None: one group of every parameter not added
    later); lr_change: dict(step, factor), every group's lr multiplied by factor before that step;
    zero_grad: call optimizer.zero_grad() after every step."""
    name, options = optimizer
    return dict(model=dict(model), optimizer=name, options=dict(options), steps=steps, seed=seed,
                perturb=perturb, add_group=add_group, groups=groups, lr_change=lr_change, zero_grad=zero_grad)


def decay_groups(spec, leave_out=(), no_decay=None):
    """Two groups at construction, as language-model training builds them: matrices with the optimizer's
    weight decay, vectors (biases) without (`no_decay`: that group's options, default weight_decay=0)."""
    shapes = {name: p.dim() for name, p in build_model(spec).named_parameters() if name not in leave_out}
    return [dict(names=[n for n, d in shapes.items() if d >= 2], options={}),
            dict(names=[n for n, d in shapes.items() if d < 2], options=dict(no_decay or {"weight_decay": 0.0}))]


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


