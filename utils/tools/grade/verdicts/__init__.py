"""Trusted verdicts: for each graded part of a lab, what runs where, on which inputs, and how it is judged.

Points come only from these verdicts. Each lab has a verdict module, `verdicts/<lab name>.py` (e.g.
`lab1_collectives.py`), defining

    PARTS = {grade_id: OnRanks(...) or InProcess(...), ...}    one entry per graded test cell of the lab
    NOTE = "..."                                               optional: a line every student's feedback carries
    LIMITS = {"timeout": s, "cell_timeout": s, "verdict_timeout": s}   optional: the lab's own time limits

The checker (utils/tools/grade/checker.py) runs no student code itself. It starts processes that run the
lab's definition cells (imports, helper functions) and the submission's solution cells, draws each case's
inputs unpredictably (os.urandom; shapes from a generator seeded by the submission), hands each process only its own inputs, gets raw tensors and JSON numbers
back, computes the expected values itself and calls the part's `judge`. Draw inputs with
`unpredictable_integers` (os.urandom); lengths and other shapes may come from the `rng` each `cases` gets.

- `OnRanks`: a distributed part. For each world size, fresh gloo process groups on that many rank processes;
  `program(namespace, params, inputs)` runs on every rank (trusted code from this module, running in a process
  that also runs student code) and returns (outputs, measured): a list of tensors (anything else is reported by
  its type name) and a dict of numbers it measured there (e.g. bytes sent).
- `InProcess`: a plain-Python part. `program(namespace, params)` runs in one child process and returns JSON
  values (use `scalar()` on what student code returned).

What a program *measures* inside a process that runs student code (bytes sent, messages, "no built-in
collective") is only as trustworthy as that process: it catches mistakes, not deliberate tampering. Values
(tensors, numbers) are judged in the checker and cannot be faked without computing them.

Labs 2 and 3 (`lab2_ddp.py`, `lab3_sharded_optimizer.py`) do the same for a class: the program builds the model,
wraps it with the student's class, trains a few steps and returns parameters, gradients (and, for lab 2, buffers,
forward outputs and an event trace) packed into at most 16 tensors per case (rank.MAX_OUTPUTS), judged against a
reference the checker computes on its own.
"""
from __future__ import annotations

import importlib.util
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

FOLDER = Path(__file__).resolve().parent


@dataclass
class Case:
    """One case of a part. `params` (JSON) goes to every process; `inputs[r]` (tensors) only to rank r;
    `expected` never leaves the checker. `label` names the case in feedback (e.g. "length 1003, float64"):
    it must not reveal the inputs."""
    label: str
    params: dict = field(default_factory=dict)
    inputs: list = field(default_factory=list)
    expected: object = None


@dataclass
class Result:
    """What came back from one process for one case: `value` (OnRanks: a list whose items are tensors, or
    the type name of something that is not a tensor; InProcess: a JSON value), `measured` (numbers), or
    `error` ("TypeName: message (where)") when the student's code raised."""
    value: object = None
    measured: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class OnRanks:
    program: Callable       # on every rank: program(namespace, params, inputs) -> (outputs, measured)
    world_sizes: tuple
    cases: Callable         # in the checker: cases(world_size, rng) -> [Case]
    judge: Callable         # in the checker: judge(world_size, case, [Result per rank]) -> [problem lines]
    what: str               # the student's function, as messages name it
    summary: str            # what a pass establishes, for the feedback


@dataclass
class InProcess:
    program: Callable       # in the child: program(namespace, params) -> JSON value
    cases: Callable         # in the checker: cases(rng) -> [Case]
    judge: Callable         # in the checker: judge(case, Result) -> [problem lines]
    what: str
    summary: str


class NotDefined(NameError):
    """The function a part grades is not defined by the lab's cells and the solution cells."""


def function(namespace: dict, name: str):
    """The student's `name` from the namespace the solution cells ran in (a clear error if missing)."""
    fn = namespace.get(name)
    if not callable(fn):
        raise NotDefined(f"{name} is not defined: the verdict runs the lab's import and helper cells and your "
                         "solution cells only, so everything it needs must be in your solution cells")
    return fn


def scalar(value):
    """A JSON-safe copy of what student code returned: a number, bool, None or short string as itself,
    anything else as {"type": its type name}."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return value[:200]
    return {"type": type(value).__name__}


def returned_type(value) -> str | None:
    """The type name a scalar() stood in for, else None."""
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return value["type"][:100]
    return None


def unpredictable_integers(count: int, low: int, high: int):
    """A 1-D int64 tensor of `count` integers in [low, high] drawn from the operating system's cryptographic
    source (`os.urandom`), so no process can predict them, nor derive one rank's inputs from another's (a
    seeded generator's outputs would reveal its state). For inputs; lengths and other shapes may come from
    the `rng` the checker passes (a random.Random seeded from the submission's cells: a regrade meets the same
    cases), since feedback names them anyway."""
    import torch

    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    raw = torch.frombuffer(bytearray(os.urandom(4 * count)), dtype=torch.int32).to(torch.int64)
    return raw.remainder(high - low + 1) + low


# ------------------------------------------------------------------ finding a lab's verdicts

class VerdictError(ValueError):
    """A lab without verdicts, or verdicts that do not match the lab's graded parts."""


def module_path(lab_name: str, folder=None) -> Path:
    return (Path(folder or FOLDER) / f"{lab_name}.py").resolve()


def load_module(path):
    """Import a verdict module from its file (the checker and every rank do this the same way)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_verdicts_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(lab_name: str, grade_ids, folder=None):
    """The verdict module of a lab, checked against the lab's graded parts; VerdictError if it does not fit."""
    path = module_path(lab_name, folder)
    if not path.is_file():
        raise VerdictError(f"{lab_name}: no verdicts ({path} does not exist). Every graded part needs a "
                           "trusted verdict: see 'Adding a lab' in INSTRUCTORS.md.")
    try:
        module = load_module(path)
    except Exception as error:
        raise VerdictError(f"{path}: could not be imported: {type(error).__name__}: {error}") from None
    parts = getattr(module, "PARTS", None)
    if not isinstance(parts, dict):
        raise VerdictError(f"{path}: defines no PARTS dict")
    missing, extra = set(grade_ids) - set(parts), set(parts) - set(grade_ids)
    if missing or extra:
        raise VerdictError(f"{path}: PARTS must name exactly the lab's graded parts; "
                           + "; ".join(filter(None, [missing and f"missing {sorted(missing)}",
                                                     extra and f"not in the lab {sorted(extra)}"])))
    for grade_id, spec in parts.items():
        if not isinstance(spec, (OnRanks, InProcess)):
            raise VerdictError(f"{path}: PARTS[{grade_id!r}] is not an OnRanks or InProcess")
        if isinstance(spec, OnRanks) and (not spec.world_sizes or not all(
                isinstance(n, int) and 1 <= n <= 64 for n in spec.world_sizes)):
            raise VerdictError(f"{path}: PARTS[{grade_id!r}] needs world sizes between 1 and 64")
    return module
