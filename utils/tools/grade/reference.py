"""PRIVATE: the labs' reference formulas. The student distribution leaves this module out (with the whole grade
package); the grader's verdicts use it, and the lab checks students receive hold only values generated from it
for their fixed cases (tests/test_lab1_checks.py keeps those stored values in step with these formulas).

Labs 2–3 add their reference formulas here too when their checks need them.
"""
from __future__ import annotations

import math

from utils.labchecks.lab1 import power_of_two_below


# ------------------------------------------------------------------ lab 1, part 4: the α-β cost model

def lab1_ring_time(n, nbytes, alpha, beta):
    """Seconds of a ring all-reduce of `nbytes` on `n` ranks in the α-β model."""
    return 2 * (n - 1) * (alpha + nbytes / n * beta)


def lab1_halving_doubling_time(n, nbytes, alpha, beta):
    """Seconds of halving-doubling with the lab's fold rule, `nbytes` on `n` ranks, in the α-β model."""
    p, steps = power_of_two_below(n)
    time = 2 * steps * alpha + 2 * (p - 1) / p * nbytes * beta
    if n > p:
        time += 2 * (alpha + nbytes * beta)  # fold in and hand back: a whole tensor each way
    return time


def lab1_crossover(n, alpha, beta):
    """The largest M at which halving-doubling is at least as fast as the ring: math.inf if it never loses
    (N a power of two), 0.0 if it loses for every M > 0."""
    p, steps = power_of_two_below(n)
    fold = 1 if n > p else 0
    latency_saved = 2 * (n - 1) - 2 * steps - 2 * fold                 # in units of α
    bandwidth_lost = 2 * (p - 1) / p + 2 * fold - 2 * (n - 1) / n        # in units of β × M
    if bandwidth_lost <= 1e-12:
        return math.inf if latency_saved >= 0 else 0.0
    return max(0.0, latency_saved * alpha / (bandwidth_lost * beta))


def lab1_expected(kind, key):
    """The expected value of one cost-model case, as lab1.check_cost_model's `expected` takes it: `kind`
    "ring_time" or "halving_doubling_time" with key (n, nbytes, alpha, beta), "crossover_bytes" with (n, alpha, beta)."""
    return {"ring_time": lab1_ring_time, "halving_doubling_time": lab1_halving_doubling_time,
            "crossover_bytes": lab1_crossover}[kind](*key)


def lab1_expected_tables(cases):
    """({(n, nbytes, alpha, beta): (ring time, halving-doubling time)}, {(n, alpha, beta): crossover}) for cases:
    what lab1_cost.py stores for its fixed cases."""
    times = {tuple(c): (lab1_ring_time(*c), lab1_halving_doubling_time(*c)) for c in cases}
    crossings = {(n, a, b): lab1_crossover(n, a, b) for n, _, a, b in cases}
    return times, crossings


def lab1_tables_source(cases) -> str:
    """The Python text of lab1_cost.py's stored tables (`python -m utils.tools.grade.reference` prints it)."""
    times, crossings = lab1_expected_tables(cases)
    def number(x):
        return "math.inf" if x == math.inf else repr(x)
    lines = ["EXPECTED_TIMES = {  # (n, nbytes, alpha, beta): (ring_time, halving_doubling_time)"]
    lines += [f"    {key!r}: ({number(r)}, {number(h)})," for key, (r, h) in times.items()]
    lines += ["}", "EXPECTED_CROSSOVER = {  # (n, alpha, beta): crossover_bytes"]
    lines += [f"    {key!r}: {number(v)}," for key, v in crossings.items()]
    lines += ["}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from utils.labchecks.lab1 import COST_CASES
    print(lab1_tables_source(COST_CASES), end="")
