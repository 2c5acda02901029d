"""Several "nodes" on one Linux machine: network namespaces as hosts, veth pairs as cables, `tc tbf` as the network.

    with Cluster(nodes=2, rate="200mbit") as cluster:         # needs root, Linux and iproute2 (`ip`, `tc`)
        cluster.address(0), cluster.address(1)                # '10.200.3.1', '10.200.3.2'
        cluster.run(1, ["ping", "-c", "1", cluster.address(0)])
        jobs = cluster.torchrun(["lessons/scripts/train_ddp.py", "--steps", "20"], nproc_per_node=2)
    # here every namespace, link and process the cluster made is gone (cluster.leftovers() == [])

    python -m utils.tools.cluster check      one line: whether this machine can run it, and what it needs if not
    python -m utils.tools.cluster demo       the README's two-node torchrun command, run on two namespaces
    python -m utils.tools.cluster sweep      remove what a killed run left (its creator's process is gone)

The network. Two nodes are joined by one veth pair; more nodes each have a veth to a bridge in a namespace of its
own (a switch). Every node's interface is `eth0` with the address 10.B.C.(i+1)/24; `lo` is up too, so ranks of one
node talk through the loopback, unshaped (a node's fast interconnect), and ranks of different nodes through the
veth. `tbf` shapes what *leaves* an interface, so it sits on both ends of each cable: `rate` in each direction.
Only bandwidth is set: this machine's kernel has no `netem`, so no delay is added and α is the real stack's.

Names. A run takes a free slot s under a lock; its namespaces are `dpfs<s>p<pid>n<i>` (and `...sw` for the switch)
and its subnet 10.(200 + s // 256).(s % 256).0/24, so concurrent runs (parallel test workers) never share a name or a
subnet. The interfaces are created inside the namespaces and never exist in the machine's own.

Teardown. On leaving the `with` block (an exception, Ctrl-C, or SIGTERM, which the block turns into an exception
while it runs in the main thread) every process started in a namespace is stopped, then every process still in one
is killed, then the namespaces are deleted, which deletes their links. A creator killed outright (SIGKILL) cannot
clean up: the next Cluster, or `sweep`, deletes the namespaces whose creator process is gone.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:
    from .namespaces import _NAME, _delete, _ip, _namespaces, _run_checked, _stop, ours, sweep
else:   # run as a file (`python utils/tools/cluster.py hold`), which imports neither the utils package nor torch
    from namespaces import _NAME, _delete, _ip, _namespaces, _run_checked, _stop, ours, sweep

__all__ = ["Cluster", "ClusterUnavailable", "unavailable", "sweep", "ours", "REQUIRE_VARIABLE"]

REQUIRE_VARIABLE = "COURSE_REQUIRE_CLUSTER"   # =1: tests fail, not skip, where the cluster cannot run (CI sets it)
_SLOTS = 4096
IFACE = "eth0"


class ClusterUnavailable(RuntimeError):
    """This machine cannot make the cluster; the message says what it needs."""


def unavailable() -> str | None:
    """None if this machine can make a cluster, else one line saying what it needs."""
    if not sys.platform.startswith("linux"):
        return f"the namespace cluster needs Linux (network namespaces); this is {sys.platform}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the namespace cluster needs iproute2's {' and '.join(missing)} on PATH (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "the namespace cluster needs root (ip netns, tc): run as root, e.g. in CI or a container"
    missing = [name for name, bit in (("CAP_SYS_ADMIN", 21), ("CAP_NET_ADMIN", 12)) if not _capable(bit)]
    if missing:
        return (f"the namespace cluster needs root with {' and '.join(missing)} (a container: run it with "
                f"--cap-add SYS_ADMIN --cap-add NET_ADMIN, or --privileged)")
    return None


def _capable(bit: int) -> bool:
    """Whether this process has capability number `bit` in effect (Linux's /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return True   # cannot tell: let `ip` say



class Cluster:
    """`nodes` namespaces on one machine joined by shaped links; a context manager (see the module's docstring).

    rate: tbf's rate per direction of each link ("200mbit", "1gbit"; None: unshaped); burst and latency: tbf's
    bucket size and queue limit. `rate_bytes` is the rate in bytes per second.
    """

    def __init__(self, nodes: int = 2, rate: str | None = "200mbit", burst: str = "64kb", latency: str = "100ms"):
        """Check and keep the settings; `up()` (or entering the block) makes the namespaces."""
        if nodes < 2:
            raise ValueError(f"a cluster has at least 2 nodes, got {nodes}")
        self.nodes, self.rate, self.burst, self.latency = nodes, rate, burst, latency
        self.rate_bytes = _rate_bytes(rate) if rate else None
        self.slot = None
        self.processes: list[subprocess.Popen] = []
        self.temp_dirs: list[str] = []   # the torchrun agents' TMPDIRs (their torchelastic_* logs), removed by down()
        self._previous_sigterm = None

    # ---- names and addresses
    def namespace(self, node: int) -> str:
        """The name of node `node`'s namespace."""
        return f"dpfs{self.slot}p{os.getpid()}n{node}"

    @property
    def switch(self) -> str:
        """The name of the switch's namespace (more than 2 nodes)."""
        return f"dpfs{self.slot}p{os.getpid()}sw"

    def names(self) -> list[str]:
        """Every namespace this cluster makes."""
        return [self.namespace(i) for i in range(self.nodes)] + ([self.switch] if self.nodes > 2 else [])

    def address(self, node: int) -> str:
        """Node `node`'s address on its `eth0`."""
        return f"10.{200 + self.slot // 256}.{self.slot % 256}.{node + 1}"

    # ---- life cycle
    def __enter__(self) -> "Cluster":
        """`up()`; in the main thread, SIGTERM raises inside the block (so that teardown runs)."""
        self.up()
        if _in_main_thread() and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._previous_sigterm = signal.signal(signal.SIGTERM, _sigterm_raises)
        return self

    def __exit__(self, *exc) -> None:
        """`down()`, and the previous SIGTERM handler back."""
        try:
            self.down()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    def up(self) -> "Cluster":
        """Make the namespaces, links and shapers. On any failure, what was made is removed again."""
        why = unavailable()
        if why:
            raise ClusterUnavailable(why)
        sweep()
        with open(__file__, "rb") as lock:   # this file as the lock: nothing left behind in /tmp
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = {int(_NAME.match(n).group(1)) for n in ours()}
            self.slot = next((s for s in range(_SLOTS) if s not in taken), None)
            if self.slot is None:
                raise RuntimeError(f"all {_SLOTS} cluster slots are taken: `python -m utils.tools.cluster sweep`")
            try:
                for name in self.names():     # made under the lock: the slot is taken once its names exist
                    _ip("netns", "add", name)
            except BaseException:
                self.down()
                raise
        try:
            self._wire()
        except BaseException:
            self.down()
            raise
        return self

    def _wire(self) -> None:
        """Bring up `lo`, lay the cables (a veth pair, or one per node to a bridge), address and shape them."""
        for node in range(self.nodes):
            _ip("link", "set", "lo", "up", netns=self.namespace(node))
        if self.nodes == 2:   # one cable
            _ip("link", "add", IFACE, "netns", self.namespace(0), "type", "veth",
                "peer", "name", IFACE, "netns", self.namespace(1))
            ends = [(self.namespace(0), IFACE), (self.namespace(1), IFACE)]
        else:                 # a switch: one cable per node to a bridge
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            ends = []
            for node in range(self.nodes):
                port = f"p{node}"
                _ip("link", "add", IFACE, "netns", self.namespace(node), "type", "veth",
                    "peer", "name", port, "netns", self.switch)
                _ip("link", "set", port, "master", "br0", netns=self.switch)
                _ip("link", "set", port, "up", netns=self.switch)
                ends += [(self.namespace(node), IFACE), (self.switch, port)]
        for node in range(self.nodes):
            ns = self.namespace(node)
            _ip("addr", "add", f"{self.address(node)}/24", "dev", IFACE, netns=ns)
            _ip("link", "set", IFACE, "up", netns=ns)
        if self.rate:
            for ns, dev in ends:
                _run_checked(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                              "rate", self.rate, "burst", self.burst, "latency", self.latency])

    def down(self) -> None:
        """Stop every process started here, kill what is left in the namespaces, delete them (and their links)."""
        for proc in self.processes:
            _stop(proc)
        self.processes.clear()
        for folder in self.temp_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        self.temp_dirs.clear()
        if self.slot is None:
            return
        for name in self.names():
            if name in _namespaces():
                _delete(name)
        left = self.leftovers()
        if left:
            raise RuntimeError(f"cluster teardown left {left} behind")

    def leftovers(self) -> list[str]:
        """This cluster's namespaces that still exist (empty after a teardown)."""
        existing = set(_namespaces())
        return [name for name in self.names() if name in existing] if self.slot is not None else []

    # ---- running things on a node
    def command(self, node: int, argv: list[str]) -> list[str]:
        """`argv` as a command that runs inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)] + [str(a) for a in argv]

    def popen(self, node: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` in node `node` (its own session, so teardown stops its whole process group)."""
        proc = subprocess.Popen(self.command(node, argv), start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, node: int, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` in node `node` to its end; output captured as text."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        proc = self.popen(node, argv, stdout=subprocess.PIPE if kwargs.pop("capture_output") else None,
                          stderr=subprocess.PIPE, text=kwargs.pop("text"), **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            _stop(proc)
            self.processes.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def tx_bytes(self, node: int) -> int:
        """Bytes node `node` has sent over its link so far (the kernel's counter: payload and headers)."""
        out = _ip("-s", "-j", "link", "show", IFACE, netns=self.namespace(node))
        import json
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def torchrun(self, script_args: list[str], nproc_per_node: int = 2, port: int = 29500, env: dict | None = None,
                 torchrun_args: list[str] = (), **popen_kwargs) -> list[subprocess.Popen]:
        """The README's multi-node command, on every node: one torchrun agent per namespace, node 0 the
        rendezvous host. Returns the agents (stdout/stderr as popen_kwargs say)."""
        env = dict(os.environ if env is None else env)
        env["GLOO_SOCKET_IFNAME"] = IFACE
        # torchrun leaves its log folder (torchelastic_*) in the temp dir: give the agents one that down() removes
        env["TMPDIR"] = tempfile.mkdtemp(prefix="torchrun-")
        self.temp_dirs.append(env["TMPDIR"])
        agents = []
        for node in range(self.nodes):
            argv = [sys.executable, "-m", "torch.distributed.run"] + torchrun_options(
                self.nodes, nproc_per_node, self.address(0), port, self.address(node), host=node == 0)
            agents.append(self.popen(node, argv + list(torchrun_args) + list(script_args), env=env,
                                     **popen_kwargs))
        return agents


def torchrun_options(nnodes: int, nproc_per_node: int, endpoint: str, port: int, local_addr: str,
                     host: bool) -> list[str]:
    """torchrun's options for one node of a multi-node job. `--local-addr` is the address the other nodes reach
    this one at (without it torchrun advertises the hostname, which may resolve to an address they cannot reach);
    `is_host=1` on the node that runs the rendezvous store (without it an agent decides by comparing the
    endpoint with its own hostname and addresses, which inside a namespace can fail: then no store is started)."""
    options = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{endpoint}:{port}", "--local-addr", local_addr]
    if host:
        options += ["--rdzv-conf", "is_host=1"]
    return options


def _rate_bytes(rate: str) -> float:
    """tc's rate ("200mbit", "1gbit", "25mbps") in bytes per second."""
    match = re.fullmatch(r"([\d.]+)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not match:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 200mbit, 1gbit or 25mbps")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return value / 8 if match.group(3) == "bit" else value


def _in_main_thread() -> bool:
    """Whether this is the main thread (the only one that may set a signal handler)."""
    import threading
    return threading.current_thread() is threading.main_thread()


def _sigterm_raises(signum, frame):
    """The SIGTERM handler inside a Cluster's block: an exception, so that the block's teardown runs."""
    raise KeyboardInterrupt("SIGTERM")


# ---------------------------------------------------------------- command line
def _demo(args) -> int:
    """The README's two-node command on two namespaces: train_ddp.py, 2 ranks per node."""
    script = Path(__file__).resolve().parents[2] / "lessons" / "scripts" / "train_ddp.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with Cluster(nodes=2, rate=args.rate) as cluster:
        print(f"2 nodes: {cluster.namespace(0)} at {cluster.address(0)}, {cluster.namespace(1)} at "
              f"{cluster.address(1)}; link {args.rate} each way", flush=True)
        for node in range(2):
            options = torchrun_options(2, args.nproc_per_node, cluster.address(0), 29500, cluster.address(node),
                                       node == 0)
            print(f"node {node}: GLOO_SOCKET_IFNAME={IFACE} torchrun {' '.join(options)} {script.name} "
                  f"--steps {args.steps}", flush=True)
        agents = cluster.torchrun([str(script), "--steps", str(args.steps), "--log-every", "0"],
                                  nproc_per_node=args.nproc_per_node, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        outputs = [agent.communicate(timeout=args.timeout) for agent in agents]
        for node, (agent, (out, err)) in enumerate(zip(agents, outputs)):
            if agent.returncode != 0:
                print(f"node {node} failed (exit {agent.returncode}):\n{err}", file=sys.stderr)
                return 1
        print(outputs[0][0], end="")
        names = cluster.names()
    left = [name for name in names if name in _namespaces()]
    print(f"teardown: {'nothing left' if not left else f'LEFT {left}'}")
    return 0 if not left else 1


def main(argv=None) -> int:
    """`python -m utils.tools.cluster check|demo|hold|sweep` (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m utils.tools.cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("check", help="say whether this machine can make the cluster")
    demo = sub.add_parser("demo", help="run the README's two-node torchrun command on two namespaces")
    demo.add_argument("--rate", default="200mbit")
    demo.add_argument("--steps", type=int, default=50)
    demo.add_argument("--nproc-per-node", type=int, default=2)
    demo.add_argument("--timeout", type=float, default=600)
    hold = sub.add_parser("hold", help="make a cluster, print its names, wait to be interrupted (for tests)")
    hold.add_argument("--nodes", type=int, default=2)
    sub.add_parser("sweep", help="remove namespaces whose creating process is gone")
    args = parser.parse_args(argv)
    if args.what == "check":
        why = unavailable()
        print(why or "this machine can make the namespace cluster")
        return 1 if why else 0
    if args.what == "sweep":
        gone = sweep() if not unavailable() else []
        print(f"removed {len(gone)} namespace(s) of finished runs: {' '.join(gone) or '-'}")
        return 0
    why = unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    if args.what == "demo":
        return _demo(args)
    with Cluster(nodes=args.nodes) as cluster:
        cluster.popen(0, ["sleep", "600"])
        print(" ".join(cluster.names()), flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
