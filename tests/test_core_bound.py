"""utils.core_bound: the core-sharing bound's assumptions, read from CPU times, and the account of a shortfall."""
import pytest

from utils.core_bound import CoreBound, cpu_topology, measurable, part, signed_ms, span, spans_zero


def rounds(one_core=1.0, others=0.0, machine=True, count=4):
    """Synthetic kept rounds: 1, 2 and 4 ranks, 30 timed steps each, on 2 cores."""
    out = {}
    for rep in range(count):
        r = {}
        for n, step, busy in ((1, 0.010, one_core), (2, 0.012, 0.85), (4, 0.030, 0.42)):
            wall = 30 * step * (1 + 0.01 * rep)
            cpu = n * busy * wall
            r[n] = {"timed_wall_s": wall, "ranks_cpu_s": cpu, "timed_allreduce_s": 0.2 * wall,
                    "machine_busy_s": cpu + others * wall if machine else None, "step_ms": 1e3 * wall / 30}
        out[rep] = r
    return out


def test_bound_is_min_n_cores_over_n():
    b = CoreBound(rounds(), cores=2, ticks=100, timed_steps=30)
    assert [b.bound(n) for n in (1, 2, 4)] == [1.0, 1.0, 0.5]


def test_assumptions_hold_on_a_quiet_machine():
    b = CoreBound(rounds(), cores=2, ticks=100, timed_steps=30)
    assert b.one_core == pytest.approx(1.0) and b.inflation == pytest.approx(0.0, abs=1e-12)
    assert b.why_not(2) is None and b.why_not(4) is None
    assert b.others_text(2).endswith("none measurable")
    # a tick per core per run over the runs' wall time: 2 cores x 4 runs / 100 ticks/s / wall
    wall = sum(r[2]["timed_wall_s"] for r in b.rounds.values())
    assert b.tick_margin(2) == pytest.approx(2 * 4 / 100 / wall)


@pytest.mark.parametrize("kwargs, args, words", [
    ({"one_core": 0.8}, {}, "not a whole one"),
    ({"one_core": 1.2}, {}, "more than the one core"),
    ({"others": 0.3}, {}, "not clearly under 0.25"),
    ({"machine": False}, {}, "no /proc/stat"),
    ({}, {"quota": 1.5}, "CPU quota of 1.5 cores"),
    ({}, {"physical": 1}, "SMT (hyperthreading) siblings on 1 physical core"),
    ({}, {"physical": None}, "separate cores or SMT siblings sharing one is unknown"),
])
def test_each_failed_assumption_leaves_the_bound_unresolved(kwargs, args, words):
    b = CoreBound(rounds(**kwargs), cores=2, ticks=100, timed_steps=30, **args)
    assert words in b.why_not(4)


def test_the_account_adds_up_and_is_exact_for_constructed_times():
    b = CoreBound(rounds(), cores=2, ticks=100, timed_steps=30)
    a, per = b.accounts(4)
    assert len(per) == 4 and CoreBound.parts_add_up([a] + per)
    # 4 ranks at 0.42 of a core each keep 1.68 of the 2 cores busy: 0.32 unused
    assert a["unused"] == pytest.approx(0.32)
    broken = dict(a, extra_cpu=a["extra_cpu"] + 1.0)
    assert not CoreBound.parts_add_up([broken])


def test_signed_figures_never_print_minus_zero():
    assert signed_ms(-0.01) == "+0.0" and signed_ms(1.26) == "+1.3"
    assert span([{"x": -0.04}, {"x": 2.0}], "x") == "+0.0 to +2.0 over the rounds"


def test_a_part_whose_range_spans_0_is_not_measurable():
    clear = [{"x": 1.4}, {"x": 2.5}]
    across = [{"x": -0.4}, {"x": 4.4}]
    assert not spans_zero(clear, "x") and spans_zero(across, "x") and spans_zero([{"x": 0.0}, {"x": 1.0}], "x")
    assert spans_zero([{"x": -0.2}, {"x": -0.01}], lambda p: p["x"] + 0.1)
    assert part(1.8, clear, "x", "cores left unused") == " +1.8 ms cores left unused (+1.4 to +2.5 over the rounds)"
    assert part(1.8, across, "x", "extra CPU work") == (
        "extra CPU work: not measurable here (range spans 0: -0.4 to +4.4 over the rounds; mean +1.8 ms)")
    # a part that rounds to 0.0 ms in every round says so, rather than "+0.0 to +0.0"
    assert part(0.001, [{"x": -0.01}, {"x": 0.02}], "x", "y") == "y: not measurable here (under 0.05 ms either way in every round)"
    # ... also when every round's value lies on one side of 0: a consistent +0.0 is no measured part either
    tiny = [{"x": 0.01}, {"x": 0.03}]
    assert not spans_zero(tiny, "x") and not measurable(tiny, "x")
    assert part(0.02, tiny, "x", "y") == "y: not measurable here (under 0.05 ms either way in every round)"
    assert measurable(clear, "x") and not measurable(across, "x") and measurable([{"x": 0.01}, {"x": 0.06}], "x")


def test_the_account_marks_a_part_that_some_round_lacks():
    b = CoreBound(rounds(), cores=2, ticks=100, timed_steps=30)
    a, per = b.accounts(2)
    # constructed times: the one-rank run's CPU time equals its wall time in every round, so that part spans 0
    assert "not measurable here" in part(a["one_rank_cpu_beyond_wall"], per, "one_rank_cpu_beyond_wall", "x")
    assert not spans_zero(per, "off_cpu") and "not measurable" not in part(a["off_cpu"], per, "off_cpu", "x")


def test_the_conditions_name_the_runs_each_figure_belongs_to():
    b = CoreBound(rounds(), cores=2, ticks=100, timed_steps=30)
    text = b.conditions(4)
    assert text.startswith("one-rank runs: 1.00 of a core") and "other processes during the 4-rank runs: " in text


def fake_sysfs(tmp_path, siblings):
    """A /sys/devices/system/cpu with one thread_siblings_list per CPU."""
    for cpu, text in siblings.items():
        folder = tmp_path / "sys" / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return str(tmp_path / "sys")


def test_cpu_topology_counts_smt_siblings_as_one_core(tmp_path):
    none = str(tmp_path / "no-cpuinfo")
    # 1 thread per core (this course's CI machine): 2 CPUs, 2 cores
    assert cpu_topology({0, 1}, fake_sysfs(tmp_path / "a", {0: "0", 1: "1"}), none) == (2, 2)
    # 2 threads per core (a typical 2-vCPU cloud VM): 2 CPUs, 1 core
    assert cpu_topology({0, 1}, fake_sysfs(tmp_path / "b", {0: "0-1", 1: "0-1"}), none) == (2, 1)
    # 4 CPUs on 2 cores, siblings listed apart ("0,2"); only the affinity set counts
    sys_c = fake_sysfs(tmp_path / "c", {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert cpu_topology({0, 1, 2, 3}, sys_c, none) == (4, 2) and cpu_topology({0, 2}, sys_c, none) == (2, 1)


def test_cpu_topology_falls_back_to_cpuinfo_then_unknown(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(f"processor\t: {p}\nphysical id\t: 0\ncore id\t\t: {p % 2}\n\n" for p in range(4)))
    missing = str(tmp_path / "no-sys")
    assert cpu_topology({0, 1, 2, 3}, missing, str(cpuinfo)) == (4, 2)
    assert cpu_topology({0, 1}, missing, str(cpuinfo)) == (2, 2)
    assert cpu_topology({0, 1}, missing, str(tmp_path / "none")) == (2, None)


def test_cpu_topology_of_this_machine_is_consistent():
    cpus, cores = cpu_topology()
    assert cpus >= 1 and (cores is None or 1 <= cores <= cpus)
