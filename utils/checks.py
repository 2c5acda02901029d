"""State a claim and prove it: print a ✓ line when it holds, raise when it does not.

A lesson never just prints ✗: a false claim stops the notebook (and fails nbval in CI).
"""
import torch


def check(condition, claim: str, detail: str = "") -> None:
    """Print `✓ claim` if `condition` is true, else raise AssertionError('✗ claim: detail')."""
    if not condition:
        raise AssertionError(f"✗ {claim}" + (f": {detail}" if detail else ""))
    print(f"✓ {claim}")


def max_abs_diff(actual, expected) -> float:
    """Largest |actual − expected| over tensors, or over lists/tuples/dicts of tensors."""
    if isinstance(actual, dict):
        if actual.keys() != expected.keys():
            raise ValueError(f"different keys: {sorted(actual)} vs {sorted(expected)}")
        return max((max_abs_diff(actual[k], expected[k]) for k in actual), default=0.0)
    if isinstance(actual, (list, tuple)):
        if len(actual) != len(expected):
            raise ValueError(f"different lengths: {len(actual)} vs {len(expected)}")
        return max((max_abs_diff(a, e) for a, e in zip(actual, expected)), default=0.0)
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    if actual.shape != expected.shape:
        raise ValueError(f"different shapes: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - expected.double()).abs().max().item()


def check_close(actual, expected, tol: float, claim: str) -> float:
    """Check max |actual − expected| ≤ tol; print the verdict; return the raw difference.

    Print the returned number in a separate cell marked `# NBVAL_IGNORE_OUTPUT`: its last digits
    depend on the CPU, the verdict does not.
    """
    diff = max_abs_diff(actual, expected)
    check(diff <= tol, f"{claim} (tolerance {tol:g})", f"max |diff| = {diff:.3g} > {tol:g}")
    return diff


def formula_check(condition, claim: str, detail: str = "") -> None:
    """Print `formula check: claim` if `condition` holds, else raise AssertionError('✗ formula check: …').

    For arithmetic identities, and for a model or a simulation compared with its own algebra: no run could
    refute them, so they print no ✓ and do not read like evidence. Keep `check` (✓) for claims a run could
    have refuted.
    """
    _labelled("formula check", condition, claim, detail)


def instrument_check(condition, claim: str, detail: str = "") -> None:
    """Print `instrument check: claim` if `condition` holds, else raise AssertionError('✗ instrument check: …').

    For what an API's semantics guarantee, read off the run's own measurements: no rank leaves a blocking
    all-reduce before the slowest rank has entered it, so the fast ranks' time inside it holds their wait. Such a
    line makes the mechanism visible on the measured times, but it could fail only if the instrument (the timers,
    the trace, the launch plumbing) were broken, so it prints no ✓ and does not read like evidence.
    """
    _labelled("instrument check", condition, claim, detail)


def _labelled(label: str, condition, claim: str, detail: str) -> None:
    """Print `label: claim` if `condition` holds, else raise AssertionError('✗ label: claim: detail')."""
    if not condition:
        raise AssertionError(f"✗ {label}: {claim}" + (f": {detail}" if detail else ""))
    print(f"{label}: {claim}")
