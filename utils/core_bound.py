"""The core-sharing bound of a scaling measurement on CPUs, and the account of a shortfall against it.

N ranks with one compute thread each, on c cores, can reach at most min(N, c) / N scaling efficiency: beyond c
they share the cores. That bound assumes four things: every CPU counted is a core of its own (no SMT/hyperthreading
siblings sharing one core: `cpu_topology` reads that), every core counted is usable (no cgroup CPU quota caps them),
the one-rank run had one whole core, and the ranks had the cores to themselves. `CoreBound` reads, from the CPU
times a measurement recorded, whether those held, and splits a step's excess over the bound into parts.

`rounds` is {round: {world size: result}}, a result being rank 0's summary from lessons/scripts/train_ddp.py's
`train(time_allreduce=True)` plus two sums over the ranks: "ranks_cpu_s" (their CPU time over the timed steps)
and "cores_used". Keys read: timed_wall_s, ranks_cpu_s, machine_busy_s (None off Linux), timed_allreduce_s,
step_ms.
"""
from __future__ import annotations

import os
import pathlib
from typing import Iterable, Mapping

from .timing import Spread


def _cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list such as "0-3,8,10-11"."""
    cpus = set()
    for item in text.strip().split(","):
        if item:
            low, _, high = item.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def _cores_from_sysfs(cpus: Iterable[int], root: pathlib.Path) -> int | None:
    """Distinct physical cores among `cpus`: CPUs listed as each other's SMT siblings share one; None if unreadable."""
    try:
        return len({_cpu_list((root / f"cpu{c}" / "topology" / "thread_siblings_list").read_text()) for c in cpus})
    except (OSError, ValueError):
        return None


def _cores_from_cpuinfo(cpus: Iterable[int], path: pathlib.Path) -> int | None:
    """The same from /proc/cpuinfo's (physical id, core id) per processor (x86 Linux); None if it lacks them."""
    try:
        blocks = path.read_text().strip().split("\n\n")
    except OSError:
        return None
    core_of = {}
    for block in blocks:
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}
        if "processor" in fields and "core id" in fields:
            core_of[int(fields["processor"])] = (fields.get("physical id", "0"), fields["core id"])
    cpus = list(cpus)
    if not all(c in core_of for c in cpus):
        return None
    return len({core_of[c] for c in cpus})


def machine_busy_seconds(cpus=None, stat: str = "/proc/stat") -> float | None:
    """CPU seconds that all processes of this machine have spent busy since boot on the CPUs `cpus` (default: the
    ones this process may run on, its affinity set), from the per-CPU lines of Linux's /proc/stat (counted in clock
    ticks per core, SC_CLK_TCK of them a second); None where that file does not exist."""
    try:
        with open(stat) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    if cpus is None:
        cpus = os.sched_getaffinity(0)
    ticks = 0
    for line in lines:
        name, *values = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:   # cpu0, cpu1, ... (not the total)
            user, nice, system, idle, iowait, irq, softirq, steal = ([int(v) for v in values] + [0] * 8)[:8]
            ticks += user + nice + system + irq + softirq + steal                   # guest time is in user
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_topology(cpus: Iterable[int] | None = None, sys_cpu: str = "/sys/devices/system/cpu",
                 cpuinfo: str = "/proc/cpuinfo") -> tuple[int, int | None]:
    """(logical CPUs this process may run on, the physical cores they sit on, or None where the system does not say).

    `os.sched_getaffinity` counts logical CPUs: two SMT (hyperthreading) siblings are two CPUs but one core, and
    two threads on them do not run twice as fast as one. The cores are read from Linux's sysfs topology (each CPU's
    thread_siblings_list), else from /proc/cpuinfo's core ids; elsewhere (macOS, Windows) they are unknown."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = sorted(cpus)
    cores = _cores_from_sysfs(cpus, pathlib.Path(sys_cpu))
    if cores is None:
        cores = _cores_from_cpuinfo(cpus, pathlib.Path(cpuinfo))
    return len(cpus), cores


class CoreBound:
    def __init__(self, rounds: Mapping[int, Mapping[int, dict]], cores: int, ticks: int, timed_steps: int,
                 quota: float | None = None, others_cut: float = 0.25, physical: int | None = -1):
        """`cores`: the logical CPUs the ranks may run on; `physical`: the physical cores those sit on (from
        `cpu_topology`; None where unknown; the default -1 means "take `cores` as physical", for tests);
        `ticks`: /proc/stat's clock ticks a second (SC_CLK_TCK); `timed_steps`: timed steps per run; `quota`: the
        cores a cgroup CPU quota allows, None if none; `others_cut`: the most of a core other processes may take
        for a verdict against the bound."""
        self.rounds, self.cores, self.ticks, self.timed_steps = rounds, cores, ticks, timed_steps
        self.quota, self.others_cut = quota, others_cut
        self.physical = cores if physical == -1 else physical
        self.world_sizes = sorted(next(iter(rounds.values())))
        self.use = {n: self._core_use(n) for n in self.world_sizes}
        # the 'others' reading's margin per world size: the ticks' rounding at worst, or the size of the lowest
        # reading if one came out further below 0 (which no real load gives: it shows the error directly)
        lowest = [-others for _, others in self.use.values() if others is not None]
        self.others_margin = {n: max([self.tick_margin(n)] + lowest) for n in self.world_sizes}
        self.one_core = self.use[1][0]  # the cores the one-rank runs had: below 1, the efficiencies are inflated
        # a one-rank run with less than a whole core is slowed, which raises every efficiency by up to this
        self.inflation = max(1 / self.one_core - 1, 0)

    def bound(self, n: int) -> float:
        """The efficiency n single-threaded ranks can reach on these CPUs: min(n, cores) / n (a bound that
        `why_not` judges against only when every CPU counted is a core of its own)."""
        return min(n, self.cores) / n

    def _core_use(self, n):
        """(cores the n ranks kept busy, cores other processes used or None off Linux), over all kept rounds'
        timed steps together: CPU seconds over rank 0's wall seconds."""
        wall = self._wall(n)
        ours = sum(r[n]["ranks_cpu_s"] for r in self.rounds.values()) / wall
        if any(r[n]["machine_busy_s"] is None for r in self.rounds.values()):
            return ours, None
        return ours, sum(r[n]["machine_busy_s"] for r in self.rounds.values()) / wall - ours

    def _wall(self, n: int) -> float:
        """Rank 0's wall seconds over the n-rank runs' timed steps, all kept rounds together."""
        return sum(r[n]["timed_wall_s"] for r in self.rounds.values())

    def tick_margin(self, n: int) -> float:
        """The most /proc/stat's rounding to whole ticks can move the n-rank 'others' reading, in cores: a tick
        per core per run, over the runs' wall time (rank 0's)."""
        return self.cores * len(self.rounds) / self.ticks / self._wall(n)

    def others_text(self, n: int) -> str:
        """The others' reading with its margin: within its margin of 0 it shows no measurable load."""
        others = self.use[n][1]
        if others is None:
            return "unknown (no /proc/stat)"
        return f"{others:+.2f} ± {self.others_margin[n]:.2f} core" + (
            ": none measurable" if others <= self.others_margin[n] else "")

    def why_not(self, n: int) -> str | None:
        """None when the bound's four assumptions held for n ranks (as far as the CPU times show), else why not."""
        others = self.use[n][1]
        if self.physical is None:
            return (f"whether the {self.cores} CPUs counted are separate cores or SMT siblings sharing one is unknown "
                    "on this system (no CPU topology to read)")
        if self.physical < self.cores:
            return (f"the {self.cores} CPUs counted are SMT (hyperthreading) siblings on {self.physical} physical "
                    f"core{'s' if self.physical != 1 else ''}: siblings share a core, so the bound taken from the CPU "
                    "count is too high and the shortfall would show up as extra CPU work")
        if self.quota is not None and self.quota < self.cores:
            return (f"a CPU quota of {self.quota:g} cores caps the {self.cores} CPUs this process may run on, so the "
                    "bound taken from the CPU count does not apply")
        if self.one_core < 0.9:
            return f"the one-rank runs had {self.one_core:.2f} of a core (CPU time over wall time), not a whole one"
        if self.one_core > 1.1:
            return (f"the one-rank runs kept {self.one_core:.2f} cores busy (CPU time over wall time), more than the "
                    "one core per rank that the bound assumes")
        if others is None:
            return "no /proc/stat on this system, so what other processes took is unknown"
        if others + self.others_margin[n] > self.others_cut:  # decide only outside the reading's margin
            return (f"other processes used {others:.2f} of the {self.cores} cores during the {n}-rank runs, not "
                    f"clearly under {self.others_cut} (the reading's margin: {self.others_margin[n]:.2f} core)")
        return None

    def conditions(self, n: int) -> str:
        """What the CPU times say about the assumptions that held, for a verdict line."""
        return (f"one-rank runs: {self.one_core:.2f} of a core"
                + (f" (which raises efficiencies by up to {self.inflation:.0%})" if round(self.inflation, 2) > 0 else "")
                + f"; other processes during the {n}-rank runs: {self.others_text(n)} (under {self.others_cut} even "
                f"with the margin); the {self.cores} CPUs counted are {self.physical} separate cores as the OS reports "
                "them (no SMT siblings listed)")

    # --- the account of a shortfall -------------------------------------------------------------------------

    def step_bound_ms(self, r: Mapping[int, dict], n: int) -> float:
        """The core bound for a whole step in round r: one rank's step of the same round, stretched by n / min(n, c)."""
        return r[1]["step_ms"] / self.bound(n)

    def accounting(self, n: int, kept) -> dict:
        """Means over the timed steps of the rounds `kept`, in ms: the n-rank step, its core bound, and the parts of
        the excess.

        The n ranks have c = min(n, cores) cores to share; over rank 0's wall time they kept `ours` of them busy. So
        c x step = n x (CPU per rank-step) + (c - ours) x step, and step - bound splits exactly into three parts:
        extra CPU work per rank-step over one rank's, the c - ours cores the ranks left unused (blocked, or pushed
        off by other processes), and the one-rank run's CPU time beyond its wall time (about 0 when it had a whole
        core; positive when its threads together used more CPU time than wall time, negative when it spent time
        off its CPU: then the bound, taken from its wall time, is too high). Means, not medians: the identity needs
        sums."""
        steps, c = self.timed_steps * len(kept), min(n, self.cores)
        mean_ms = lambda m, key: 1e3 * sum(r[m][key] for r in kept) / steps
        step, step1 = mean_ms(n, "timed_wall_s"), mean_ms(1, "timed_wall_s")
        cpu, cpu1 = mean_ms(n, "ranks_cpu_s") / n, mean_ms(1, "ranks_cpu_s")
        ours = n * cpu / step  # the cores the ranks kept busy over these rounds
        return {"step": step, "bound": step1 / self.bound(n), "cpu": cpu, "cpu1": cpu1, "unused": c - ours,
                "allreduce": mean_ms(n, "timed_allreduce_s"), "extra_cpu": n * (cpu - cpu1) / c,
                "off_cpu": (c - ours) * step / c, "one_rank_cpu_beyond_wall": n * (cpu1 - step1) / c}

    def accounts(self, n: int) -> tuple[dict, list[dict]]:
        """The account over all kept rounds together, and the same account round by round (its spread)."""
        return self.accounting(n, list(self.rounds.values())), [self.accounting(n, [r]) for r in self.rounds.values()]

    @staticmethod
    def parts_add_up(accounts) -> bool:
        """The identity of the account: step - bound = the three parts, in every account given."""
        return all(abs(p["step"] - p["bound"] - p["extra_cpu"] - p["off_cpu"] - p["one_rank_cpu_beyond_wall"])
                   < 1e-6 * p["step"] for p in accounts)

    def per_round(self, value) -> Spread:
        """The spread over the kept rounds of value(round), a round being {world size: rank 0's result}."""
        return Spread.of([value(r) for r in self.rounds.values()])


def signed_ms(value: float) -> str:
    """A signed figure to 0.1 ms, never "-0.0"."""
    return f"{round(value, 1) + 0.0:+.1f}"


def _values(per: list[dict], key) -> list[float]:
    get = key if callable(key) else (lambda p: p[key])
    return [get(p) for p in per]


def span(per: list[dict], key) -> str:
    """'low to high over the rounds' of per-round accounts' `key` (a name, or a function of an account)."""
    values = _values(per, key)
    return f"{signed_ms(min(values))} to {signed_ms(max(values))} over the rounds"


def spans_zero(per: list[dict], key) -> bool:
    """Whether the per-round values of `key` reach 0 or lie on both sides of it: then some round had none of that
    part (or its opposite), and its mean is no measured difference."""
    values = _values(per, key)
    return min(values) <= 0 <= max(values)


def measurable(per: list[dict], key) -> bool:
    """Whether a part was measured in every round: its per-round values lie on one side of 0 (see `spans_zero`) and
    at least one is 0.05 ms or more in size, so that it shows at the 0.1 ms the lines print (a part under that in
    every round, whatever its sign, prints as +0.0 and is no measured cause)."""
    return not spans_zero(per, key) and max(abs(v) for v in _values(per, key)) >= 0.05


def part(mean: float, per: list[dict], key, label: str) -> str:
    """One part of the account for a line: "+1.8 ms <label> (range over the rounds)" when it is `measurable`,
    else "<label>: not measurable here (under 0.05 ms either way in every round)" when every round's value rounds
    to 0.0 ms, whatever its sign, or "<label>: not measurable here (range spans 0: ...; mean ...)"."""
    if max(abs(v) for v in _values(per, key)) < 0.05:
        return f"{label}: not measurable here (under 0.05 ms either way in every round)"
    if spans_zero(per, key):
        return f"{label}: not measurable here (range spans 0: {span(per, key)}; mean {signed_ms(mean)} ms)"
    return f"{signed_ms(mean):>5} ms {label} ({span(per, key)})"
