"""Lab 1's verdicts (labs/lab1_collectives.ipynb): the four graded parts, judged where no student code runs.

    reduce_scatter     reduce_scatter(tensor) on N = 2 … 6: rank r must return chunk r of the sum
    all_gather         all_gather(chunk, length) on N = 2 … 6: every rank must return the whole tensor
    halving_doubling   all_reduce_halving_doubling(tensor) on N = 2 … 6 (3, 5, 6 fold): the sum on every rank
    cost_comparison    ring_time, halving_doubling_time, crossover_bytes against utils/tools/grade/reference.py

Each world size gets fresh cases: lengths N divides and lengths it does not (1 and N-1 elements, so some chunks
are empty; one element per chunk, 2N+1, a random uneven length, a random multiple of the per-rank byte rule's
divisor, a random long one), each in float32,
float64 and int64. Values are small integers (multiples of 1/8 for floats, so every sum is exact in any order)
from os.urandom, so one rank's inputs say nothing about another's; lengths come from the checker's random
source, seeded from the submission (the same cases at every grading of it). The checker computes the sums and compares every element of every rank's result.

The traffic rules are the lab's own: lab1.traffic_problems judges every case (peers, message caps, the ring's
bytes per rank at every length, halving-doubling's per rank where the chunking is even and all ranks' together
at every length), so a submission that pads chunks or cuts messages up fails. Bytes, messages, peers
and "point-to-point calls only" are measured inside the rank processes, which also run the student's code:
they are advisory against deliberate tampering (NOTE below says so in every feedback).
"""
from __future__ import annotations

import math

import torch

from utils import bytecount
from utils.labchecks import lab1
from utils.labchecks.harness import fmt

from utils.tools.grade import reference
from utils.tools.grade.verdicts import Case, InProcess, OnRanks, function, returned_type, scalar, unpredictable_integers

WORLD_SIZES = (2, 3, 4, 5, 6)
DTYPES = ("float32", "float64", "int64")
# The lab's own time limits (the grader's options override them; a notebook's "grading" metadata too). The
# reference runs in ~10 s per run: a cell gets 60 s (the lab's own deadlock report comes after check_timeout =
# 30 s), a verdict step (one part at one N) 30 s, each of the two runs 240 s. An endless loop costs about a minute.
LIMITS = {"timeout": 240, "cell_timeout": 60, "verdict_timeout": 30}
NOTE = ("Bytes, messages, peers and 'point-to-point calls only' are measured inside your own rank processes "
        "(which also run your code): they catch mistakes, and are advisory against deliberate tampering.")


# ------------------------------------------------------------------ on every rank (trusted code, untrusted process)

def run_collective(namespace, params, inputs):
    """Call the student's collective on this rank's input, counting its traffic; built-in collectives forbidden."""
    fn = function(namespace, params["function"])
    arguments = [inputs[0]] + ([params["length"]] if params.get("pass_length") else [])
    with bytecount.count_bytes() as counter, bytecount.forbid_collectives():
        got = fn(*arguments)
    summary = counter.summary()
    measured = {key: summary[key] for key in ("sent", "received", "messages_sent")}
    for peer, moved in summary.get("by_peer", {}).items():
        measured[f"to {peer}"], measured[f"from {peer}"] = moved["sent"], moved["received"]
    return [got], measured


def run_cost_model(namespace, params):
    """The student's cost functions on every argument list; the answers as JSON scalars."""
    fn = function(namespace, params["function"])
    return [scalar(fn(*arguments)) for arguments in params["calls"]]


# ------------------------------------------------------------------ in the checker: cases

def _values(length, dtype):
    """Unpredictable small integers, as int64, or as multiples of 1/8 (sums of a few are exact in any order)."""
    values = unpredictable_integers(length, -1024, 1024)  # floats: 14 bits for a sum of 6, exact in float32
    return values if dtype == "int64" else values.to(getattr(torch, dtype)) / 8


def _lengths(n, divisor, rng):
    """One element per chunk, 2N+1, an uneven length, a multiple of the per-rank byte rule's divisor, a long
    one, then empty chunks (1 and N-1 elements)."""
    uneven = rng.choice([length for length in range(3 * n, 400) if length % n])
    return list(dict.fromkeys([n, 2 * n + 1, uneven, divisor * rng.randint(8, 40), rng.randint(1000, 3000),
                               1, n - 1]))


FUNCTIONS = {"reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
             "halving_doubling": "all_reduce_halving_doubling"}


def _collective_cases(kind, divisor):
    """cases(n, rng) for one collective: every rank's input drawn here, the expected result kept here."""
    def cases(n, rng):
        out = []
        for length in _lengths(n, divisor(n), rng):
            for dtype in DTYPES:
                if kind == "all_gather":  # rank r holds chunk r of a tensor; everyone must end with all of it
                    total = _values(length, dtype)
                    inputs = [[total[a:b].clone()] for a, b in lab1.chunk_bounds(length, n)]
                else:
                    inputs = [[_values(length, dtype)] for _ in range(n)]
                    total = torch.stack([i[0] for i in inputs]).sum(0).to(getattr(torch, dtype))
                params = {"function": FUNCTIONS[kind], "pass_length": kind == "all_gather", "length": length}
                out.append(Case(f"length {length}, {dtype}", params, inputs,
                                {"length": length, "dtype": dtype, "total": total, "inputs": inputs}))
        return out
    return cases


def _cost_cases(rng):
    """The notebook's visible cases (lab1.COST_CASES) plus random ones: world sizes from 2 to 4096, sizes from
    100 B to 10 GB, α and β over several orders of magnitude. `rng` is seeded from the submission (checker.py),
    so a regrade draws the same cases."""
    sizes = [2, 3, 4, 5, 6, 7, 8, 12, 1000, 1024] + [rng.randint(9, 4096) for _ in range(4)] + \
            [2 ** rng.randint(4, 12)]
    visible = list(lab1.COST_CASES)
    hidden = [(n, 10 ** rng.uniform(2, 10), 10 ** rng.uniform(-7, -4), 1 / 10 ** rng.uniform(8, 11.5))
              for n in sizes for _ in range(2)]
    times = [(args, False) for args in visible] + [(args, True) for args in hidden]
    crossings = [(args, False) for args in dict.fromkeys((n, a, b) for n, _, a, b in visible)] + \
                [((n, 10 ** rng.uniform(-7, -4), 1 / 10 ** rng.uniform(8, 11.5)), True) for n in sizes]
    out = []
    for name, formula, calls in [("ring_time", reference.lab1_ring_time, times),
                                 ("halving_doubling_time", reference.lab1_halving_doubling_time, times),
                                 ("crossover_bytes", reference.lab1_crossover, crossings)]:
        out.append(Case(f"{name}", {"function": name, "calls": [list(args) for args, _ in calls]}, [],
                        [(args, hidden, formula(*args)) for args, hidden in calls]))
    return out


# ------------------------------------------------------------------ in the checker: judging

def _value_problem(kind, rank, n, case, got):
    """One line saying how this rank's result differs from the expected, or None."""
    label, total = case.label, case.expected["total"]
    bounds = lab1.chunk_bounds(case.expected["length"], n)
    start, stop = bounds[rank]
    want = total[start:stop] if kind == "reduce_scatter" else total
    if isinstance(got, str):
        return f"rank {rank}, {label}: returned {got}, expected a tensor"
    if got.dtype != want.dtype:
        return f"rank {rank}, {label}: returned dtype {got.dtype}, expected {want.dtype} (keep the input's dtype)"
    if tuple(got.shape) != tuple(want.shape):
        return f"rank {rank}, {label}: returned shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if torch.equal(got, want):
        return None
    return lab1.diagnose(kind, got, total, case.expected["inputs"][rank][0], bounds, rank, label)


def _summary(measured):
    """A rank's measured traffic (run_collective's dict) in the byte counter's form, for lab1.traffic_problems."""
    by_peer = {}
    for key, amount in measured.items():
        direction, _, peer = key.partition(" ")
        if direction in ("to", "from") and peer.lstrip("-").isdigit():
            entry = by_peer.setdefault(int(peer), {"sent": 0, "received": 0})
            entry["sent" if direction == "to" else "received"] += amount
    return {"sent": measured.get("sent", 0), "received": measured.get("received", 0),
            "messages_sent": measured.get("messages_sent", 0), "by_peer": by_peer}


def _judge_collective(kind):
    def judge(n, case, results):
        values = [_value_problem(kind, rank, n, case, r.value[0] if r.value else "nothing")
                  for rank, r in enumerate(results)]
        problems = [v for v in values if v]
        if problems:
            return problems
        length, dtype = case.expected["length"], case.expected["dtype"]
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        volume, peers = lab1.traffic_problems(_LAB_KINDS[kind], n, length, itemsize,
                                              [_summary(r.measured) for r in results])
        return volume + list(peers.values())
    return judge


def _call(name, args, hidden):
    """How a call reads in feedback: a random case's inputs only to two digits (enough to say which case)."""
    names = ("n", "nbytes", "alpha", "beta") if len(args) == 4 else ("n", "alpha", "beta")
    shown = ", ".join(f"{k}={v}" if k == "n" else f"{k}≈{v:.2g}" if hidden else f"{k}={fmt(v)}"
                      for k, v in zip(names, args))
    return f"{name}({shown})" + (" (a random case)" if hidden else "")


def _judge_cost(case, result):
    name = case.params["function"]
    accept = lab1.accept_crossover if name == "crossover_bytes" else lab1.accept_time
    answers = result.value if isinstance(result.value, list) else []
    for index, (args, hidden, want) in enumerate(case.expected):
        got = answers[index] if index < len(answers) else None
        kind = returned_type(got) or (repr(got) if got is None or isinstance(got, (bool, str)) else None)
        if kind is not None:
            return [f"{_call(name, args, hidden)} returned {kind}: return a number (a Python float or int)"]
        if not accept(got, want):
            unit = "bytes" if name == "crossover_bytes" else "s"
            return [f"{_call(name, args, hidden)} = {got!r}, expected {want:.6g} {unit}"]
    return []


def _power_divisor(n):
    p, _ = lab1.power_of_two_below(n)
    return math.lcm(n, p)


_LAB_KINDS = {"reduce_scatter": "reduce_scatter", "all_gather": "all_gather", "halving_doubling": "all_reduce"}
_RING_SUMMARY = ("; around a ring in at most N-1 messages, M minus one chunk each way per rank at every length "
                 "(padding or resending fails), (N-1)/N × M where N divides the length")
_SUMMARY = ("exact on every rank for N = 2 … 6, on lengths N divides and lengths it does not, empty chunks "
            "included, in float32, float64 and int64, with fresh random inputs")

PARTS = {
    "reduce_scatter": OnRanks(run_collective, WORLD_SIZES, _collective_cases("reduce_scatter", lambda n: n),
                              _judge_collective("reduce_scatter"), "reduce_scatter", _SUMMARY + _RING_SUMMARY),
    "all_gather": OnRanks(run_collective, WORLD_SIZES, _collective_cases("all_gather", lambda n: n),
                          _judge_collective("all_gather"), "all_gather", _SUMMARY + _RING_SUMMARY),
    "halving_doubling": OnRanks(run_collective, WORLD_SIZES,
                                _collective_cases("halving_doubling", _power_divisor),
                                _judge_collective("halving_doubling"),
                                "all_reduce_halving_doubling",
                                _SUMMARY + "; halving-doubling's partners and messages (fold rule) at every "
                                "length, its bytes per rank where N and p divide the length and all ranks' bytes "
                                "together at every length"),
    "cost_comparison": InProcess(run_cost_model, _cost_cases, _judge_cost, "the cost model",
                                 "ring_time, halving_doubling_time and crossover_bytes match the α-β model on the "
                                 "notebook's cases and on random ones (N up to 4096)"),
}
