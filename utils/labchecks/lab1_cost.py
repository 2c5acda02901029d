"""Lab 1's part 4: the α–β cost model of the ring and halving-doubling all-reduces, checked against stored values.

  check_cost_model(ring_time, halving_doubling_time, crossover_bytes)
`accept_time` and `accept_crossover` are the acceptance rules the grader's verdicts share.
"""
from __future__ import annotations

import math
import numbers

from ..checks import check
from .harness import LabCheckFailure

# The checks hold the expected values of the lab's fixed cases, not the formulas (they are the exercise): the
# course's private reference module (left out of the student distribution) generated EXPECTED_TIMES and
# EXPECTED_CROSSOVER below, and the course's tests keep them in step with it. This module never imports
# that one (it imports this one): other cases need their expected values passed in (check_cost_model's
# `expected`).
COST_WORLD_SIZES = (2, 3, 4, 5, 6, 7, 8, 12, 1000, 1024)
COST_CASES = [(n, nbytes, 5e-6, 1 / 100e9) for n in COST_WORLD_SIZES
              for nbytes in (1e3, 1e6, 25 * 2**20, 1e9)] + [(4, 64 * 2**20, 50e-6, 1 / 2e9)] + \
    [(16, 4e3, 2e-6, 1 / 25e9)]   # a power of two where the slopes' round-off comes out negative

# A crossover at or beyond this many bytes (1 PB, far beyond any message) means "never slower": math.inf is
# the exact answer there, and a formula that subtracts two equal bandwidth terms may leave a huge finite one.
NEVER_SLOWER_BYTES = 1e15

# BEGIN GENERATED TABLES
EXPECTED_TIMES = {  # (n, nbytes, alpha, beta): (ring_time, halving_doubling_time)
    (2, 1000.0, 5e-06, 1e-11): (1.001e-05, 1.001e-05),
    (2, 1000000.0, 5e-06, 1e-11): (1.9999999999999998e-05, 1.9999999999999998e-05),
    (2, 26214400, 5e-06, 1e-11): (0.000272144, 0.000272144),
    (2, 1000000000.0, 5e-06, 1e-11): (0.01001, 0.01001),
    (3, 1000.0, 5e-06, 1e-11): (2.0013333333333334e-05, 2.0030000000000003e-05),
    (3, 1000000.0, 5e-06, 1e-11): (3.3333333333333335e-05, 4.9999999999999996e-05),
    (3, 26214400, 5e-06, 1e-11): (0.0003695253333333333, 0.0008064319999999999),
    (3, 1000000000.0, 5e-06, 1e-11): (0.013353333333333332, 0.030019999999999998),
    (4, 1000.0, 5e-06, 1e-11): (3.0015000000000003e-05, 2.0015e-05),
    (4, 1000000.0, 5e-06, 1e-11): (4.5e-05, 3.5e-05),
    (4, 26214400, 5e-06, 1e-11): (0.0004232159999999999, 0.000413216),
    (4, 1000000000.0, 5e-06, 1e-11): (0.015029999999999998, 0.015019999999999999),
    (5, 1000.0, 5e-06, 1e-11): (4.0016000000000004e-05, 3.0035e-05),
    (5, 1000000.0, 5e-06, 1e-11): (5.6000000000000006e-05, 6.5e-05),
    (5, 26214400, 5e-06, 1e-11): (0.00045943039999999996, 0.000947504),
    (5, 1000000000.0, 5e-06, 1e-11): (0.01604, 0.03503),
    (6, 1000.0, 5e-06, 1e-11): (5.001666666666667e-05, 3.0035e-05),
    (6, 1000000.0, 5e-06, 1e-11): (6.666666666666667e-05, 6.5e-05),
    (6, 26214400, 5e-06, 1e-11): (0.00048690666666666664, 0.000947504),
    (6, 1000000000.0, 5e-06, 1e-11): (0.016716666666666664, 0.03503),
    (7, 1000.0, 5e-06, 1e-11): (6.001714285714287e-05, 3.0035e-05),
    (7, 1000000.0, 5e-06, 1e-11): (7.714285714285715e-05, 6.5e-05),
    (7, 26214400, 5e-06, 1e-11): (0.0005093897142857143, 0.000947504),
    (7, 1000000000.0, 5e-06, 1e-11): (0.017202857142857145, 0.03503),
    (8, 1000.0, 5e-06, 1e-11): (7.001750000000001e-05, 3.0017500000000005e-05),
    (8, 1000000.0, 5e-06, 1e-11): (8.75e-05, 4.75e-05),
    (8, 26214400, 5e-06, 1e-11): (0.000528752, 0.000488752),
    (8, 1000000000.0, 5e-06, 1e-11): (0.017570000000000002, 0.017529999999999997),
    (12, 1000.0, 5e-06, 1e-11): (0.00011001833333333335, 4.0037500000000004e-05),
    (12, 1000000.0, 5e-06, 1e-11): (0.00012833333333333335, 7.75e-05),
    (12, 26214400, 5e-06, 1e-11): (0.0005905973333333333, 0.0010230399999999998),
    (12, 1000000000.0, 5e-06, 1e-11): (0.018443333333333332, 0.03754),
    (1000, 1000.0, 5e-06, 1e-11): (0.00999001998, 0.0001000399609375),
    (1000, 1000000.0, 5e-06, 1e-11): (0.01000998, 0.0001399609375),
    (1000, 26214400, 5e-06, 1e-11): (0.010513763712000001, 0.001147552),
    (1000, 1000000000.0, 5e-06, 1e-11): (0.029969999999999997, 0.0400609375),
    (1024, 1000.0, 5e-06, 1e-11): (0.010230019980468751, 0.00010001998046875),
    (1024, 1000000.0, 5e-06, 1e-11): (0.01024998046875, 0.00011998046875),
    (1024, 26214400, 5e-06, 1e-11): (0.010753776, 0.000623776),
    (1024, 1000000000.0, 5e-06, 1e-11): (0.030210468750000004, 0.020080468749999997),
    (4, 67108864, 5e-05, 5e-10): (0.050631648, 0.050531648000000005),
    (16, 4000.0, 2e-06, 4e-11): (6.0299999999999995e-05, 1.63e-05),
}
EXPECTED_CROSSOVER = {  # (n, alpha, beta): crossover_bytes
    (2, 5e-06, 1e-11): math.inf,
    (3, 5e-06, 1e-11): 0.0,
    (4, 5e-06, 1e-11): math.inf,
    (5, 5e-06, 1e-11): 526315.7894736843,
    (6, 5e-06, 1e-11): 1090909.090909091,
    (7, 5e-06, 1e-11): 1680000.0000000002,
    (8, 5e-06, 1e-11): math.inf,
    (12, 5e-06, 1e-11): 3652173.913043479,
    (1000, 5e-06, 1e-11): 494971769.96825105,
    (1024, 5e-06, 1e-11): math.inf,
    (4, 5e-05, 5e-10): math.inf,
    (16, 2e-06, 4e-11): math.inf,
}
# END GENERATED TABLES


def _expected(kind, key, expected=None):
    """The expected value of one case: `kind` "ring_time", "halving_doubling_time" or "crossover_bytes".
    The stored tables answer the lab's own cases; `expected(kind, key)`, when given, any other."""
    if kind == "crossover_bytes":
        if key in EXPECTED_CROSSOVER:
            return EXPECTED_CROSSOVER[key]
    elif key in EXPECTED_TIMES:
        return EXPECTED_TIMES[key][0 if kind == "ring_time" else 1]
    if expected is None:
        raise LabCheckFailure(f"✗ no stored expected value for {kind}{key}: these checks know the lab's own "
                              "cases only")
    return expected(kind, key)


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def accept_time(got, want) -> bool:
    """Is `got` an acceptable answer where `want` seconds are expected? (The grader uses this rule too.)

    A number within 1e-9 relative of `want`: the same formula written in another order agrees to ~1e-15.
    """
    return _number(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15)


def accept_crossover(got, want) -> bool:
    """Is `got` an acceptable crossover_bytes where `want` bytes are expected? (The grader uses this rule too.)

    Where halving-doubling is never slower (`want` is math.inf, or at least NEVER_SLOWER_BYTES): math.inf
    or any number ≥ NEVER_SLOWER_BYTES. Elsewhere: within 1 byte of `want` (whole bytes, rounded any way,
    pass) or 1e-4 relative, whichever is larger (a crossover solved from differences of the two cost functions
    loses digits to cancellation: 1.5e-8 relative at N = 1000 on the lab's link, up to about 1e-5 at N in the
    thousands on others; a wrong formula is off by far more).
    """
    if not _number(got):
        return False
    if want >= NEVER_SLOWER_BYTES:
        return got >= NEVER_SLOWER_BYTES
    return abs(got - want) <= max(1.0, 1e-4 * want)


def _answer(name, fn, **arguments):
    """(how the call reads, fn(**arguments)), or the LabCheckFailure that says what to do instead."""
    call = f"{name}({', '.join(f'{k}={v:g}' for k, v in arguments.items())})"
    try:
        got = fn(*arguments.values())
    except NotImplementedError:
        raise LabCheckFailure(f"✗ {name} is not implemented yet: replace "
                              "`raise NotImplementedError()` with your formula.") from None
    if not _number(got):
        raise LabCheckFailure(f"✗ {call} returned {type(got).__name__} {got!r}: return a number (a Python "
                              "float or int)")
    return call, got


def check_cost_model(ring_time, halving_doubling_time, crossover_bytes, cases=None, expected=None):
    """The three cost functions against the α-β model (α per message, β seconds per byte).

    The times are checked on `cases` (n, nbytes, alpha, beta), crossover_bytes on every (n, alpha, beta) in them.
    Cases beyond the lab's own need `expected(kind, key)` for their expected values (the tests pass the
    reference formulas' `lab1_expected`).
    """
    cases = COST_CASES if cases is None else cases
    for name, fn, hint in [
        ("ring_time", ring_time, "2(N-1) steps, each α + (M/N)·β"),
        ("halving_doubling_time", halving_doubling_time,
         "log2 p halving + log2 p doubling steps, plus the fold and the hand-back when N is not a power "
         "of two"),
    ]:
        for n, nbytes, alpha, beta in cases:
            call, got = _answer(name, fn, n=n, nbytes=nbytes, alpha=alpha, beta=beta)
            want = _expected(name, (n, nbytes, alpha, beta), expected)
            if not accept_time(got, want):
                raise LabCheckFailure(f"✗ {call} = {got!r}, expected {want:.6g} s ({hint})")
        check(True, f"{name} matches the α-β model on {len(cases)} cases")
    crossover_cases = list(dict.fromkeys((n, alpha, beta) for n, _, alpha, beta in cases))
    for n, alpha, beta in crossover_cases:
        call, got = _answer("crossover_bytes", crossover_bytes, n=n, alpha=alpha, beta=beta)
        want = _expected("crossover_bytes", (n, alpha, beta), expected)
        if accept_crossover(got, want):
            continue
        if want == math.inf:
            expected = (f"math.inf: N={n} is a power of two, so both algorithms have the same bandwidth term "
                        "(their difference is 0 up to round-off: compare it with a tolerance, not with 0) and "
                        "halving-doubling sends fewer messages, so it is never slower (any value ≥ 1e15 "
                        "passes too)")
        elif want == 0:
            expected = (f"0.0: at N={n} halving-doubling saves no latency to pay for its larger bandwidth "
                        "term, so it is slower for every message size > 0")
        else:
            expected = (f"{want:.10g} bytes, within 1 byte or 1e-4 relative (the largest M for which "
                        "halving-doubling is at least as fast as the ring)")
        raise LabCheckFailure(f"✗ {call} = {got!r}, expected {expected}")
    distinct = list(dict.fromkeys(n for n, _, _ in crossover_cases))
    sizes = ", ".join(str(n) for n in distinct)
    twice = "; some N on two different links" if len(distinct) < len(crossover_cases) else ""
    check(True, f"crossover_bytes matches the α-β model on {len(crossover_cases)} (N, α, β) cases "
                f"(N = {sizes}{twice}): "
                "within 1 byte or 1e-4 relative, or ≥ 1e15 where the answer is math.inf")
