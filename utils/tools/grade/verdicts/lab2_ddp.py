"""Lab 2's verdicts (labs/lab2_ddp.ipynb): the four graded parts, judged where no student code runs.

    construction  Wrapper(...) leaves rank 0's parameters and buffers on every rank, `.module`, forward, N = 2, 3, 4
    training      gradients after every step and parameters after the last = one process on the whole batch;
                  every trainable gradient sent once per step, in buckets within the cap; every handle waited
                  for; N = 2, 3, 4
    overlap       backward never made to wait for communication (no wait, barrier or blocking call from a
                  gradient hook before the last gradient), at least half of the last step's gradient bytes still
                  in flight when a later gradient becomes ready, every handle waited for (training right too)
    accumulation  no_sync(): nothing sent on the first k−1 micro-batches; then the average of the accumulated
                  gradients, every trainable gradient sent once

Each world size gets fresh cases: models drawn from the checker's rng (widths, vocabulary; plain, frozen, tied,
tied and frozen, which parameters are frozen; a "shuffled" model whose layers run in another order than they
are defined, so its gradients do not arrive in reverse definition order: judged on training only), bucket sizes drawn around the model's own sizes (smaller than
any parameter, medium, larger than the model), and a seed per case from os.urandom, which fixes every rank's
initial weights (different per rank: the wrapper must broadcast) and the batches. The seed stays in the checker:
each rank gets only its own inputs (`lab2.rank_inputs`: its initial parameters and buffers, its shard of each
step's micro-batches), so no rank can reconstruct another's data. A rank runs the student's
DDPBucketed through lab 2's own `run_case` and sends back raw tensors (parameters, buffers, gradients per step,
the forward's output, the trace of gradients, calls and waits) and its bytes per step (and per micro-batch
inside no_sync()) as numbers. The checker
trains one process itself (`lab2.reference_run`) and judges with lab 2's judges.

Bytes sent, `.module` and the trace of gradients, calls and waits the overlap is judged from are measured inside
the rank processes, which also run the student's code: they are advisory against deliberate tampering (NOTE says
so in every feedback). Parameters, buffers and gradients are values: judged in the checker.
"""
from __future__ import annotations

import torch

from utils.labchecks import handles, lab2

from utils.tools.grade.verdicts import Case, OnRanks, function, unpredictable_integers

WORLD_SIZES = (2, 3, 4)
# The lab's own time limits (the grader's options override them; a notebook's "grading" metadata too). The
# reference's verdicts, four parts, took 21–24 s on 2 shared, loaded cores (construction 12–13 s of it, over three
# world sizes; a verdict step is one world size) and its notebook run 16–26 s: a verdict step gets 40 s, a cell 60 s
# (the lab's own deadlock report comes after check_timeout = 30 s), each of the two runs 240 s. An endless loop
# costs about a minute.
LIMITS = {"timeout": 240, "cell_timeout": 60, "verdict_timeout": 40}
NOTE = ("Bytes sent, `.module` and the order of gradients, collectives and waits (overlap) are measured inside your own "
        "rank processes (which also run your code): they catch mistakes, and are advisory against deliberate "
        "tampering.")
GRAD, COMM, WAIT = 0, 1, 2    # the kinds of a trace event, as sent back
KINDS = {"grad": GRAD, "comm": COMM, "wait": WAIT}
MAX_OUTPUT = 4096            # elements of the forward's output sent back (a loss is one)


# ------------------------------------------------------------------ the layout both sides know from the case

def _layout(spec):
    """(parameter names and shapes, buffer names and shapes) of the case's model, in named_* order."""
    model = lab2.build_model(spec, 0)
    return ([(name, p.shape) for name, p in model.named_parameters()],
            [(name, b.shape) for name, b in model.named_buffers()])


def _pack(tensors, layout):
    """(float32 values of every entry flattened in layout order, int64 element count per entry: −1 if absent).

    An entry of the wrong size is counted but not sent (its values stay zero)."""
    values = torch.zeros(sum(shape.numel() for _, shape in layout), dtype=torch.float32)
    sizes, start = torch.full((len(layout),), -1, dtype=torch.int64), 0
    for index, (name, shape) in enumerate(layout):
        got = tensors.get(name)
        if isinstance(got, torch.Tensor):
            sizes[index] = got.numel()
            if got.numel() == shape.numel():
                values[start:start + shape.numel()] = got.detach().reshape(-1).to(torch.float32)
        start += shape.numel()
    return values, sizes


def _unpack(values, sizes, layout):
    """{name: tensor} back from _pack (absent entries left out; a wrong-sized one as NaNs of its size)."""
    out, start = {}, 0
    for index, (name, shape) in enumerate(layout):
        count = int(sizes[index])
        if count == shape.numel():
            out[name] = values[start:start + count].reshape(shape)
        elif count >= 0:
            out[name] = torch.full((count,), float("nan"))
        start += shape.numel()
    return out


# ------------------------------------------------------------------ on every rank (trusted code, untrusted process)

def _pack_inputs(case, rank, world_size):
    """Rank `rank`'s own inputs as tensors: [initial state (float32, layout order), x, y (steps × rows × length)]."""
    mine = lab2.rank_inputs(case, rank, world_size)
    parameters, buffers = _layout(case["model"])
    values, _ = _pack(mine["state"], parameters + buffers)
    return [values, torch.stack([x for x, _ in mine["batches"]]), torch.stack([y for _, y in mine["batches"]])]


def _unpack_inputs(case, inputs):
    """lab2.rank_inputs' dict back from _pack_inputs."""
    values, xs, ys = inputs
    parameters, buffers = _layout(case["model"])
    state, start = {}, 0
    for name, shape in parameters + buffers:
        state[name] = values[start:start + shape.numel()].reshape(shape)
        start += shape.numel()
    return dict(state=state, batches=list(zip(xs, ys)))


def run_wrapper(namespace, params, inputs):
    """The student's DDPBucketed on this rank through lab 2's run_case; its results as raw tensors.

    outputs: [state values, state sizes, gradient values (steps × elements), gradient sizes (steps × entries),
    parameter values, parameter sizes, the wrapper's forward output, the module's, trace (events × [step, kind,
    bytes, handle, what: handles.code of the call's or the wait's name])]; measured: module_ok, the nominal bytes sent per step, and per micro-batch run inside
    no_sync() its bytes and calls."""
    Wrapper = function(namespace, "DDPBucketed")
    case = params
    result = lab2.run_case(Wrapper, case, _unpack_inputs(case, inputs))
    parameters, buffers = _layout(case["model"])
    steps = case["steps"]
    state = _pack(result["state"], parameters + buffers)
    grads = [_pack(g, parameters) for g in result["grads"]]   # one row per step
    grad_values = torch.stack([values for values, _ in grads]) if grads else torch.zeros(0)
    grad_sizes = torch.stack([sizes for _, sizes in grads]) if grads else torch.zeros(0, dtype=torch.int64)
    wrapped, plain = result["outputs"]
    if isinstance(wrapped, str):        # run_case's "a <type name>": sent as that type name
        wrapped = type(wrapped.removeprefix("a ")[:80], (), {})()
    elif wrapped.numel() > MAX_OUTPUT:
        wrapped = type(f"Tensor of shape {tuple(wrapped.shape)}"[:80], (), {})()
    else:
        wrapped = wrapped.to(torch.float32)
    trace = [(step, KINDS[event[0]], int(event[2]), int(event[4]), handles.code(event[1]))
             for step, events in enumerate(result["events"]) for event in events]
    outputs = [*state, grad_values, grad_sizes, *_pack(result["params"], parameters), wrapped,
               plain.to(torch.float32), torch.tensor(trace, dtype=torch.int64).reshape(-1, 5)]
    measured = {"module_ok": int(bool(result["module_ok"]))}
    measured.update({f"bytes {step}": result["bytes"][step] for step in range(min(steps, len(result["bytes"])))})
    for step, quiet in enumerate(result["quiet"]):
        for micro, (sent, calls) in enumerate(quiet):
            measured.update({f"quiet bytes {step} {micro}": sent, f"quiet calls {step} {micro}": calls})
    return outputs, measured


# ------------------------------------------------------------------ in the checker: cases

def _model(rng, kind):
    """A random model of `kind` (plain, frozen, tied, tied+frozen: 2 to 4 layers of random widths; shuffled: 3 to
    5 equal layers applied in a random order other than their definition order)."""
    if kind == "shuffled":
        layers = rng.randint(3, 5)
        order = list(range(layers))
        while order == sorted(order):
            rng.shuffle(order)
        return dict(name=kind, vocab=rng.randint(8, 24), widths=[rng.choice([16, 24, 32])] * (layers + 1),
                    order=order)
    widths = [rng.choice([8, 16, 24, 32, 40, 48]) for _ in range(rng.randint(3, 5))]
    if "tied" in kind:
        widths[-1] = widths[0]   # the head's weight is the embedding's: vocabulary × embedding width
    spec = dict(name=kind, vocab=rng.randint(8, 24), widths=widths, tied="tied" in kind)
    if "frozen" in kind:
        names = [name for name, _ in _layout(spec)[0]]
        frozen = rng.sample([n for n in names if n != "wte.weight"], rng.randint(1, 2))
        if "tied" in kind and rng.random() < 0.3:
            frozen[0] = "wte.weight"   # the tied weight frozen: both its uses get no gradient
        spec["frozen"] = frozen
    return spec


def _bucket_sizes(rng, spec):
    """MiB: smaller than any trainable parameter, medium (about a quarter of the gradients), larger than the model."""
    sizes = [p.numel() * p.element_size() for p in lab2.build_model(spec, 0).parameters() if p.requires_grad]
    total = sum(p.numel() * p.element_size() for p in lab2.build_model(spec, 0).parameters())
    return [rng.uniform(0.1, 0.9) * min(sizes) / lab2.MiB,
            rng.uniform(0.15, 0.4) * sum(sizes) / lab2.MiB,
            rng.uniform(1.1, 8.0) * total / lab2.MiB]


def _seed():
    return int(unpredictable_integers(1, 0, 2**31 - 1)[0])


def _reference(case, n):
    """lab2.reference_run on one thread: these models are tiny, and more threads only contend for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return lab2.reference_run(case, n)
    finally:
        torch.set_num_threads(threads)


def _case(n, spec, bucket_size_mb, steps, rng, accumulation=1):
    case = lab2.make_case(spec, bucket_size_mb, steps=steps, seq_len=rng.randint(4, 8), seed=_seed(),
                          accumulation=accumulation)
    widths = ", ".join(map(str, spec["widths"]))
    label = f"model '{spec['name']}' (widths {widths}, vocabulary {spec['vocab']}"
    label += f", frozen {', '.join(spec['frozen'])}" if spec.get("frozen") else ""
    label += f", layers applied in the order {spec['order']})" if spec.get("order") else ")"
    label += f", buckets of {bucket_size_mb * lab2.MiB:,.0f} bytes"
    label += f", {accumulation} micro-batches per step" if accumulation > 1 else ""
    shared = {key: value for key, value in case.items() if key != "seed"}   # the seed stays here
    return Case(label, shared, [_pack_inputs(case, r, n) for r in range(n)], {"reference": _reference(case, n)})


def _construction_cases(n, rng):
    """No training step (steps=0): construction is judged apart from the gradients."""
    specs = [_model(rng, kind) for kind in ("frozen", "tied+frozen")]
    return [_case(n, spec, rng.choice(_bucket_sizes(rng, spec)), 0, rng) for spec in specs]


def _training_cases(n, rng):
    """Every model kind with every bucket size, 3 SGD steps each."""
    out = []
    for kind in ("plain", "frozen", "tied", "tied+frozen", "shuffled"):
        spec = _model(rng, kind)
        out += [_case(n, spec, size, 3, rng) for size in _bucket_sizes(rng, spec)]
    return out


def _overlap_cases(n, rng):
    """Equal layers, buckets of about two of them (the notebook's shape, drawn afresh), 2 steps."""
    width, layers = rng.choice([32, 48, 64]), rng.randint(6, 9)
    spec = dict(name=f"{layers} equal layers", vocab=rng.randint(8, 24), widths=[width] * (layers + 1))
    layer = (width * width + width) * 4
    return [_case(n, spec, rng.uniform(1.6, 2.4) * layer / lab2.MiB, 2, rng)]


def _accumulation_cases(n, rng):
    """A plain and a tied+frozen model, 2 to 4 micro-batches per step, a medium and a smaller-than-any bucket
    size, 2 SGD steps."""
    out = []
    for kind in ("plain", "tied+frozen"):
        spec = _model(rng, kind)
        sizes = _bucket_sizes(rng, spec)
        out.append(_case(n, spec, rng.choice(sizes[:2]), 2, rng, accumulation=rng.randint(2, 4)))
    return out


# ------------------------------------------------------------------ in the checker: judging

def _rank_results(case, results):
    """lab2.run_case's dicts, rebuilt from what came back (anything malformed reads as absent)."""
    spec, steps = case.params["model"], case.params["steps"]
    parameters, buffers = _layout(spec)
    n_state = sum(s.numel() for _, s in parameters + buffers)
    n_params = sum(s.numel() for _, s in parameters)

    def tensor(value, dtype, shape):
        return isinstance(value, torch.Tensor) and value.dtype == dtype and tuple(value.shape) == shape

    out = []
    for r in results:
        v = list(r.value or []) + [None] * 9
        state = _unpack(v[0], v[1], parameters + buffers) if tensor(v[0], torch.float32, (n_state,)) and tensor(
            v[1], torch.int64, (len(parameters + buffers),)) else {}
        grads = [{} for _ in range(steps)]
        if tensor(v[2], torch.float32, (steps, n_params)) and tensor(v[3], torch.int64, (steps, len(parameters))):
            grads = [_unpack(v[2][s], v[3][s], parameters) for s in range(steps)]
        grads = [{name: g.get(name) for name, _ in parameters} for g in grads]   # absent: None
        params = _unpack(v[4], v[5], parameters) if tensor(v[4], torch.float32, (n_params,)) and tensor(
            v[5], torch.int64, (len(parameters),)) else {}
        wrapped = v[6] if isinstance(v[6], torch.Tensor) else f"a {v[6]}"
        plain = v[7] if isinstance(v[7], torch.Tensor) and v[7].numel() == 1 else torch.tensor(float("nan"))
        events = [[] for _ in range(steps)]
        if isinstance(v[8], torch.Tensor) and v[8].dtype == torch.int64 and v[8].dim() == 2 and v[8].shape[1] == 5:
            names = {GRAD: "grad", COMM: "comm", WAIT: "wait"}
            for step, kind, sent, handle, what in v[8].tolist():
                if 0 <= step < steps and kind in names:   # any other kind is malformed: left out
                    events[step].append((names[kind], handles.name(what), sent if kind == COMM else 0, 0.0, handle))
        k = lab2.micro_batches(case.params)
        quiet = [[(r.measured.get(f"quiet bytes {s} {j}", -1), r.measured.get(f"quiet calls {s} {j}", -1))
                  for j in range(k - 1)] for s in range(steps)]     # absent: −1, judged as sent
        out.append(dict(state=state, module_ok=bool(r.measured.get("module_ok", 0)), outputs=(wrapped, plain),
                        grads=grads, params=params, events=events, quiet=quiet,
                        bytes=[r.measured.get(f"bytes {s}", 0) for s in range(steps)]))
    return out


def _problems(kind, n, case, results):
    ranks = _rank_results(case, results)
    reference = case.expected["reference"]
    if kind == "construction":
        return lab2.judge_construction(case.params, n, ranks, reference)
    if kind == "accumulation":
        problems = lab2.judge_quiet(case.params, n, ranks)
        if problems:
            return problems
    problems = lab2.judge_training(case.params, n, ranks, reference)
    if problems:
        return problems
    if kind == "overlap":
        return lab2.judge_overlap(case.params, n, ranks)
    problems = lab2.judge_traffic(case.params, n, ranks) or lab2.judge_waits(case.params, n, ranks)
    if kind == "training" and not problems:
        problems = lab2.judge_buckets(case.params, n, ranks)
    return problems


def _judge(kind):
    def judge(n, case, results):
        """lab 2's judges; the first problem line names the case (model and bucket size)."""
        problems = _problems(kind, n, case, results)
        return [f"{case.label}: {problems[0]}", *problems[1:]] if problems else []
    return judge


_WHAT = "DDPBucketed"
PARTS = {
    "construction": OnRanks(run_wrapper, WORLD_SIZES, _construction_cases, _judge("construction"), _WHAT,
                            "every rank holds rank 0's parameters and buffers after DDPBucketed(...), .module is "
                            "the model, forward passes through, N = 2, 3, 4, random frozen and tied models"),
    "training": OnRanks(run_wrapper, WORLD_SIZES, _training_cases, _judge("training"), _WHAT,
                        "gradients after each of 3 SGD steps and parameters after them = one process on the whole "
                        f"batch (rtol {lab2.RTOL:.0e}) on every rank, N = 2, 3, 4, random plain, frozen, tied and "
                        "tied+frozen models and one whose layers run out of definition order, buckets smaller than "
                        "any parameter, medium and larger than the model; every trainable gradient sent once per "
                        "step, in buckets within the cap (one all-reduce per gradient at a cap smaller than any, "
                        "one at a cap larger than the model, none over the cap by more than one gradient), every "
                        "handle waited for"),
    "overlap": OnRanks(run_wrapper, WORLD_SIZES, _overlap_cases, _judge("overlap"), _WHAT,
                       "backward never made to wait for communication (no wait, barrier or blocking call from a "
                       "gradient hook before the last gradient is ready), "
                       f"at least {lab2.EARLY_SHARE:.0%} of the last step's gradient bytes still in flight when a "
                       "later gradient becomes ready, on every rank, every handle waited for, and the training "
                       "right, N = 2, 3, 4, random models of equal layers with buckets of about two layers"),
    "accumulation": OnRanks(run_wrapper, WORLD_SIZES, _accumulation_cases, _judge("accumulation"), _WHAT,
                            "no_sync(): nothing sent on the first k−1 micro-batches of a step; after the k-th the "
                            "gradients and parameters = one process accumulating the k whole micro-batches, every "
                            "trainable gradient sent once, N = 2, 3, 4, random plain and tied+frozen models, k = 2 "
                            "to 4"),
}
