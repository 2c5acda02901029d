"""Check helpers raise on false claims; traces line up across ranks; the collectives shim is quiet."""
import sys
import time
import warnings

import cloudpickle
import matplotlib
import pytest
import torch
import torch.distributed as dist

import utils
from utils import checks, compat, plots, trace

matplotlib.use("Agg")
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_check_prints_tick_or_raises(capsys):
    assert checks.check(True, "two plus two is four") is None  # nothing for a notebook to echo
    assert capsys.readouterr().out == "✓ two plus two is four\n"
    with pytest.raises(AssertionError, match="✗ gradients match: off by one"):
        checks.check(False, "gradients match", "off by one")
    assert "✓" not in capsys.readouterr().out


def test_formula_check_prints_no_tick_and_raises(capsys):
    assert checks.formula_check(True, "4/3 = (C + K) / (C/2 + K) at K = C") is None
    assert capsys.readouterr().out == "formula check: 4/3 = (C + K) / (C/2 + K) at K = C\n"   # no ✓: not evidence
    with pytest.raises(AssertionError, match="✗ formula check: n\\* = 10: got 9"):
        checks.formula_check(False, "n* = 10", "got 9")
    assert capsys.readouterr().out == ""


def test_instrument_check_prints_no_tick_and_raises(capsys):
    assert checks.instrument_check(True, "the fast ranks wait inside the all-reduce") is None
    assert capsys.readouterr().out == "instrument check: the fast ranks wait inside the all-reduce\n"   # no ✓
    with pytest.raises(AssertionError, match="✗ instrument check: rank 3 waits least: rank 0 did"):
        checks.instrument_check(False, "rank 3 waits least", "rank 0 did")
    assert capsys.readouterr().out == ""


def test_check_close_returns_the_raw_difference_and_raises_beyond_tolerance(capsys):
    a = {"w": torch.tensor([1.0, 2.0]), "b": [torch.tensor(3.0)]}
    b = {"w": torch.tensor([1.0, 2.0 + 5e-7]), "b": [torch.tensor(3.0)]}
    diff = checks.check_close(a, b, 1e-6, "replicas agree")
    assert 0 < diff < 1e-6
    assert capsys.readouterr().out == "✓ replicas agree (tolerance 1e-06)\n"
    with pytest.raises(AssertionError, match=r"✗ replicas agree \(tolerance 1e-08\): max \|diff\|"):
        checks.check_close(a, b, 1e-8, "replicas agree")
    with pytest.raises(ValueError, match="different shapes"):
        checks.max_abs_diff(torch.zeros(2), torch.zeros(3))


def test_trace_spans_share_one_clock_across_ranks():
    def work():
        dist.barrier()
        with trace.span("compute", kind="compute"):
            time.sleep(0.05 * (dist.get_rank() + 1))
        with trace.span("all_reduce", kind="comm"):
            dist.all_reduce(torch.ones(10))
        return trace.collect()

    spans = utils.launch(work, world_size=3)
    # The all_reduce cannot finish anywhere before the slowest rank (rank 2) has started it.
    slowest_start = spans[2][1]["start"]
    for rank in range(3):
        assert [s["name"] for s in spans[rank]] == ["compute", "all_reduce"]
        assert all(s["rank"] == rank for s in spans[rank])
        assert spans[rank][1]["end"] >= slowest_start
    ax = plots.plot_timeline(spans, title="test")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    with pytest.raises(ValueError, match="kind must be one of"):
        with trace.span("x", kind="gpu"):
            pass


def test_collectives_shim_matches_and_never_warns():
    def work():
        warnings.simplefilter("error")  # any FutureWarning becomes a failure
        rank, world = dist.get_rank(), dist.get_world_size()
        gathered = torch.empty(world * 2)
        compat.all_gather_single(gathered, torch.full((2,), float(rank)))
        scattered = torch.empty(2)
        compat.reduce_scatter_single(scattered, torch.arange(world * 2, dtype=torch.float32))
        return gathered, scattered

    for rank, (gathered, scattered) in enumerate(utils.launch(work, world_size=2)):
        assert gathered.tolist() == [0.0, 0.0, 1.0, 1.0]
        assert scattered.tolist() == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
