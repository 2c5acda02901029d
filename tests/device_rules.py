"""The static rules tests/test_device_placement.py applies: where a lesson's, lab's or utils' code leaves a rank's
tensors, gradients, models or batches on the CPU although a launch may give it NCCL (one GPU per rank).

findings(source): tensors made without the rank's device that reach a collective. launch_findings(sources): a
launched function that all-reduces gradients and places nothing on a device. unmoved(trees): models and batches
of a launched function never moved to the rank's device. Each reads code only (the ast of each cell or file).
"""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from IPython.core.inputtransformer2 import TransformerManager

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter", "send",
               "recv", "isend", "irecv", "all_to_all", "all_to_all_single", "P2POp"}
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "arange",
             "linspace", "eye"}
EXEMPT = "# gloo only"
# files whose collectives run on gloo only, and why
GLOO_ONLY = {"utils/tools/linkbench.py": "its ranks form gloo groups (namespace nodes)",
             "benchmarks/bench_cluster_link.py": "its ranks are linkbench's",
             "benchmarks/bench_simlink.py": "it measures gloo (launch(backend='gloo'))"}


def _unplaced(node) -> bool:
    """Whether `node` makes a tensor (or a list of them) without saying it goes on the rank's device."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_unplaced(e) for e in node.elts)
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return _unplaced(node.elt)
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
        return False
    device = next((k.value for k in node.keywords if k.arg == "device"), None)
    if device is None:
        return True
    cpu = ast.unparse(device).replace("'", '"')
    return cpu in ('"cpu"', 'torch.device("cpu")')


def _collective(call) -> str | None:
    name = (call.func.attr if isinstance(call.func, ast.Attribute) else
            call.func.id if isinstance(call.func, ast.Name) else None)
    return name if name in COLLECTIVES else None


def _bindings(scope):
    """name → [(line, whether the value assigned there is an unplaced tensor)], in the scope's whole subtree."""
    bound = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Name):
                    pairs.append((target.id, node.value))
                elif (isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                      and len(target.elts) == len(node.value.elts)):
                    pairs += [(t.id, v) for t, v in zip(target.elts, node.value.elts) if isinstance(t, ast.Name)]
                elif isinstance(target, ast.Tuple):
                    pairs += [(t.id, None) for t in target.elts if isinstance(t, ast.Name)]
            for name, value in pairs:
                bound.setdefault(name, []).append((node.lineno, value is not None and _unplaced(value)))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            value = getattr(node, "value", None)
            bound.setdefault(node.target.id, []).append((node.lineno, value is not None and _unplaced(value)))
    return bound


def _reaches(arg, line, bound) -> bool:
    if _unplaced(arg):
        return True
    if isinstance(arg, (ast.List, ast.Tuple)):
        return any(_reaches(e, line, bound) for e in arg.elts)
    if isinstance(arg, ast.Starred):
        return _reaches(arg.value, line, bound)
    if isinstance(arg, ast.Name):
        before = [unplaced for at, unplaced in bound.get(arg.id, []) if at <= line]
        return bool(before) and before[-1]
    return False


def findings(source: str) -> list[str]:
    """'line N: collective(name) gets a tensor made without the rank's device' for each offence in `source`."""
    lines = source.splitlines()
    tree = ast.parse(source)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    found = set()
    for scope in scopes:
        bound = _bindings(scope)
        for call in (n for n in ast.walk(scope) if isinstance(n, ast.Call)):
            name = _collective(call)
            if name is None or EXEMPT in lines[call.lineno - 1]:
                continue
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                if _reaches(arg, call.lineno, bound):
                    found.add(f"line {call.lineno}: {name}({ast.unparse(arg)}) gets a tensor made without the "
                              "rank's device")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def _code_cells(path: Path):
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            if source.startswith("%%"):   # a cell magic (%%requires, %%time ...): its body is Python
                source = "\n" + source.split("\n", 1)[-1]
            yield index, cell.get("id"), TransformerManager().transform_cell(source)   # line magics, ! lines


SOURCES = sorted([*map(str, (ROOT / "lessons").glob("*.ipynb")), *map(str, (ROOT / "labs").glob("*.ipynb"))])
SOURCES = [os.path.relpath(p, ROOT) for p in SOURCES]
PY_SOURCES = sorted(os.path.relpath(p, ROOT) for folder in ("utils", "lessons/scripts", "benchmarks")
                    for p in (ROOT / folder).rglob("*.py"))
# ------------------------------------------------------------- CPU gradients in a launch that may pick NCCL
# The same bug one level up: a function that all-reduces gradients (it reads `.grad` and calls a collective) but
# places nothing on a device (no `.to(`, `.cuda(`, `device=` in it or in the notebook's functions it calls) keeps
# its model on the CPU; launched with backend "auto" it gets NCCL wherever every rank has a GPU, and fails there.
# It must then place its model or be launched with backend="gloo". Collectives hidden in a library (DDP, FSDP)
# and helpers defined in other files are not followed: those the first check and a GPU run have to catch.


def _launched(call) -> str | None:
    """The function name `call` launches (utils.launch(fn, ...)) unless it pins backend="gloo"."""
    name = (call.func.attr if isinstance(call.func, ast.Attribute) else
            call.func.id if isinstance(call.func, ast.Name) else None)
    if name != "launch" or not call.args or not isinstance(call.args[0], (ast.Name, ast.Attribute)):
        return None
    backend = next((k.value for k in call.keywords if k.arg == "backend"), None)
    if isinstance(backend, ast.Constant) and backend.value == "gloo":
        return None
    return call.args[0].attr if isinstance(call.args[0], ast.Attribute) else call.args[0].id


def _places(fn, functions, seen) -> bool:
    seen.add(fn.name)
    for node in ast.walk(fn):
        if (isinstance(node, ast.keyword) and node.arg == "device" or isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "cuda")):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions
                and node.func.id not in seen and _places(functions[node.func.id], functions, seen)):
            return True
    return False


def launch_findings(sources: list[str]) -> list[str]:
    """'launch(fn) at line N: ...' for each launch that may pick NCCL of a function that all-reduces CPU gradients."""
    trees = [ast.parse(source) for source in sources]
    functions = {n.name: n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    found = []
    for tree in trees:
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            fn = functions.get(_launched(call))
            if (fn and any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(fn))
                    and any(isinstance(n, ast.Call) and _collective(n) for n in ast.walk(fn))
                    and not _places(fn, functions, set())):
                found.append(f"launch({fn.name}) at line {call.lineno}: its gradients stay on the CPU, and the "
                             "launch may pick NCCL (place the model on utils.device(), or pass backend=\"gloo\")")
    return found


# ------------------------------------------------- models and batches of a rank are moved to the rank's device
# The same bug one level up: a rank that builds its model, or takes its batch, on the CPU computes its gradients
# on the CPU, and DDP or an all-reduce hands them to NCCL. The check follows what utils.launch runs: the function
# a launch names (unless it passes backend="gloo") and every function of the file it refers to, across cells. In
# those, a model (a class defined there that subclasses a Module, the course's GPT, a torch.nn layer, or a
# function of the file that returns one of these unmoved) and a batch (`<source>.batch(...)`) must be moved:
# `.to(...)` / `.cuda(...)` on the call itself, on each item taken from it (`(t.to(d) for t in source.batch(...))`),
# or on the name it is assigned to, later in the function; a model class may also be given `device=`.

MODELS = {"GPT"}                                  # the course's model classes a file may import
STATELESS = {"Parameter", "Dropout", "Identity", "ReLU", "GELU", "Softmax", "Flatten"}   # no parameters of their
                                                  # own (a Parameter takes its tensor's device)
MOVES = {"to", "cuda"}


def _parents(tree):
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node


def _moved_call(node) -> bool:
    """Whether `node` is `<x>.to(...)` or `<x>.cuda(...)`."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MOVES


def _is_launch(call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "launch") or (isinstance(func, ast.Name)
                                                                            and func.id == "launch")


def _gloo_pinned(call) -> bool:
    return any(k.arg == "backend" and isinstance(k.value, ast.Constant) and k.value.value == "gloo"
               for k in call.keywords)


def unmoved(trees) -> list[tuple[int, str]]:
    """(index of the tree, 'line N (function): <call> ...') for each model or batch made in a launched function
    and never moved to the rank's device; `trees` are the file's parsed cells (one tree for a .py file)."""
    for tree in trees:
        _parents(tree)
    functions, home, modules = {}, {}, set(MODELS)
    for index, tree in enumerate(trees):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[node.name], home[node.name] = node, index
            elif isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[-1].endswith("Module")
                                                        for b in node.bases):
                modules.add(node.name)

    def is_model(call):
        func = call.func
        if isinstance(func, ast.Name):
            return func.id in modules
        return (isinstance(func, ast.Attribute) and func.attr[:1].isupper() and func.attr not in STATELESS
                and ast.unparse(func.value) in ("torch.nn", "nn"))

    def placed(call, scope):
        parent = call.parent
        if isinstance(parent, ast.Attribute) and parent.attr in MOVES:
            return True
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id in movers
                and call in parent.args):               # passed to a notebook function that moves what it returns
            return True
        if is_model(call) and any(k.arg == "device" for k in call.keywords):
            return True
        if isinstance(parent, ast.comprehension) and parent.iter is call:
            return _moved_call(parent.parent.elt)
        if isinstance(parent, ast.Assign):
            names = {t.id for target in parent.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
            return any(_moved_call(n) and isinstance(n.func.value, ast.Name) and n.func.value.id in names
                       and n.lineno >= parent.lineno for n in ast.walk(scope))
        return False

    movers = {name for name, fn in functions.items()   # e.g. on_device(batch): returns `.to(...)`s of its input
              if any(isinstance(n, ast.Return) and n.value is not None and any(map(_moved_call, ast.walk(n.value)))
                     for n in ast.walk(fn))}

    def factory(fn):                               # returns a model unmoved: the caller must move it
        return any(isinstance(n, ast.Return) and isinstance(n.value, ast.Call) and is_model(n.value)
                   and not placed(n.value, fn) for n in ast.walk(fn))

    changed = True
    while changed:
        changed = False
        for name, fn in functions.items():
            if name not in modules and factory(fn):
                modules.add(name)
                changed = True

    reached = _reached_from_launches(trees, functions)
    found = set()
    for name in reached:
        fn = functions[name]
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            made = (isinstance(call.func, ast.Attribute) and call.func.attr == "batch") or is_model(call)
            returned = name in modules and isinstance(call.parent, ast.Return)      # a factory's own return
            if made and not returned and not placed(call, fn):
                found.add((home[name], f"line {call.lineno} ({name}): {ast.unparse(call)[:60]} is never moved to "
                                       "the rank's device"))
    return sorted(found)


# ------------------------------------------------------------- clocks read around work a GPU does asynchronously
# On NCCL a collective returns to Python once it is queued on the GPU (work.wait() too: it makes the GPU wait, not
# Python), and so do forward and backward on CUDA tensors. A clock read after them measures the queueing, not the
# work. The check: in a function that places tensors on a device (`device`, `.to(`, `.cuda(`), two clock reads
# (time.perf_counter, time.time, time.monotonic) with a `dist.<collective>` or a `.backward()` between them and
# nothing between that waits for the GPU: torch.cuda.synchronize, a CUDA event's elapsed_time, `.item()`,
# `.cpu()`, `.tolist()` (each waits for the work queued before it), or dist.barrier. The same for a
# `with trace.span(...)` block around such work without cuda_sync= (utils/trace.py: it synchronises at both ends).

CLOCKS = {"perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns"}
WAITS_FOR_GPU = {"synchronize", "elapsed_time", "item", "cpu", "tolist", "barrier"}


def _clock_read(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in CLOCKS and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id in ("perf_counter", "monotonic")


def _places_on_device(fn) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.keyword) and node.arg == "device":
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "cuda"):
            return True
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("utils.device", "device", "launching.device"):
            return True
    return False


def _reached_from_launches(trees, functions) -> set:
    """Names of the functions a launch that may pick NCCL runs (not backend="gloo"), and those they refer to.
    `functions` maps a name to its ast node, or to a tuple whose last item is the node."""
    todo = [call.args[0].id for tree in trees for call in ast.walk(tree) if isinstance(call, ast.Call)
            and _is_launch(call) and not _gloo_pinned(call) and call.args and isinstance(call.args[0], ast.Name)]
    reached = set()
    while todo:
        name = todo.pop()
        if name in functions and name not in reached:
            reached.add(name)
            node = functions[name][-1] if isinstance(functions[name], tuple) else functions[name]
            todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    return reached


def _waits_for_gpu(call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr in WAITS_FOR_GPU
    return isinstance(func, ast.Name) and "sync" in func.id          # e.g. sync = torch.cuda.synchronize


def timing_findings(sources: list[str], launched_only: bool = False) -> list[tuple[int, str]]:
    """(index of the source, 'line N (function): ...') for each clock read that follows GPU work it does not wait
    for (see above). `sources`: a notebook's cells (launched_only: only functions a launch that may pick NCCL
    runs) or one file's text."""
    trees = [ast.parse(source) for source in sources]
    functions = {n.name: (index, n) for index, tree in enumerate(trees) for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = _reached_from_launches(trees, functions) if launched_only else set(functions)
    found = {}
    for name in sorted(names):
        index, fn = functions[name]
        if not _places_on_device(fn):
            continue
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        clocks = [c for c in calls if _clock_read(c)]
        for start, end in zip(clocks, clocks[1:]):
            between = [c for c in calls if start.lineno <= c.lineno <= end.lineno and c is not start and c is not end]
            gpu_work = [c for c in between if isinstance(c.func, ast.Attribute) and (
                c.func.attr == "backward" or (_collective(c) and ast.unparse(c.func.value) == "dist"))]
            if gpu_work and not any(map(_waits_for_gpu, between)):
                innermost = min((f for f in ast.walk(fn) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                                 and f.lineno <= end.lineno <= f.end_lineno), key=lambda f: f.end_lineno - f.lineno)
                found[(index, end.lineno)] = (
                    f"line {end.lineno} ({innermost.name}): the clock is read after {ast.unparse(gpu_work[0].func)}"
                    "(...) without waiting for the GPU (on NCCL or CUDA it returns once queued: "
                    "torch.cuda.synchronize() first, where tensors are on a GPU)")
        for block in (n for n in ast.walk(fn) if isinstance(n, ast.With)):
            spans = [item.context_expr for item in block.items if isinstance(item.context_expr, ast.Call)
                     and ast.unparse(item.context_expr.func).endswith("span")
                     and not any(k.arg == "cuda_sync" and not (isinstance(k.value, ast.Constant) and not k.value.value)
                                 for k in item.context_expr.keywords)]
            inside = [n for statement in block.body for n in ast.walk(statement) if isinstance(n, ast.Call)]
            gpu_work = [c for c in inside if isinstance(c.func, ast.Attribute) and (
                c.func.attr == "backward" or (_collective(c) and ast.unparse(c.func.value) == "dist"))]
            if spans and gpu_work and not any(map(_waits_for_gpu, inside)):
                found[(index, block.lineno)] = (
                    f"line {block.lineno} ({name}): {ast.unparse(spans[0])[:50]} times "
                    f"{ast.unparse(gpu_work[0].func)}(...) without waiting for the GPU (pass cuda_sync=<its "
                    "tensor>.is_cuda)")
    return [(index, line) for (index, _), line in sorted(found.items())]


# ------------------------------------------------------------- an isend-then-recv ring, where NCCL may run it
# On gloo an isend moves in the background, so `isend` to the right, then a blocking `recv` from the left, around a
# ring completes. On NCCL (one GPU per rank, the GPU named at init) the group's point-to-point calls run in order on
# one stream and a send may wait for its receive: every rank's recv queues behind its own send, and the ring hangs.
# A function a launch that may pick NCCL runs must post both together (dist.batch_isend_irecv) or order them
# even/odd; lesson 03 shows the isend fix on gloo only (backend="gloo").


def isend_then_recv_findings(sources: list[str], launched_only: bool = False) -> list[tuple[int, str]]:
    """(index of the source, 'line N (function): ...') for each blocking dist.recv after a dist.isend in one function."""
    trees = [ast.parse(source) for source in sources]
    functions = {n.name: (index, n) for index, tree in enumerate(trees) for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = _reached_from_launches(trees, functions) if launched_only else set(functions)
    found = []
    for name in sorted(names):
        index, fn = functions[name]
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and ast.unparse(n.func.value) == "dist"]
        isends = [c.lineno for c in calls if c.func.attr == "isend"]
        for recv in (c for c in calls if c.func.attr == "recv"):
            if isends and min(isends) < recv.lineno:
                found.append((index, f"line {recv.lineno} ({name}): a blocking dist.recv after dist.isend (line "
                                     f"{min(isends)}): it can hang on NCCL; post both as one dist.batch_isend_irecv"))
    return found
