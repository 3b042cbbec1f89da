"""A shaped-link lab on one machine: one network namespace per rank, a bridge, tbf, a delayer.

Used by `tox -e netlab` (tests/netlab/test_netlab.py); needs root, iproute2, iptables,
gcc and libnetfilter-queue-dev (tools/netlab/setup.sh installs them). Facts behind the
choices (no sch_netem in this kernel, delay on the receive side, tbf burst and queue
sizes): docs/network-model.md, "Validation on shaped links".

    with Lab(rates_mbit=[100] * 4, delays_ms=[10] * 4) as lab:
        lab.popen(i, ["python", "-m", "bench.run.train", run_dir], rank_env)   # rank i

Topology: namespace `cbl-sw` holds bridge `br0`; namespace `cbl-I` holds `lab0`
(10.77.0.I+1/24), a veth whose peer `p I` sits on the bridge. Rank I's upload is shaped by
tbf on `lab0`, its download by tbf on `pI`; received packets on `lab0` pass an NFQUEUE
held by tools/netlab/delay.c for delays_ms[I], run real-time (`DELAYER_RT_PRIORITY`).
Nothing is routed out: no uplink, no default route, addresses only inside the namespaces.
`close()` kills the delayers and deletes the namespaces (which removes the veths and the
bridge). `Lab(..., shaped=False)` starts with the links' rates unshaped (no tbf; the
delays on); `switch(lab.description(), shaped)` puts the tbf on or takes it off, from any
process (the in-run A/B of tests/netlab/traced.py).

TCP congestion control: every namespace runs `congestion_control` (default "cubic", the
Linux default; $NETLAB_CC overrides it in the experiment). A host whose default is BBR
(this one) would otherwise hand it to every namespace, and BBR paces gloo's short,
application-limited bursts at a fraction of the link (1 Gbit/s + 10 ms: 125 kB bursts
spread over 7.7 ms instead of 1 ms; docs/network-model.md). Setting a CC in a namespace
needs it in the global `tcp_allowed_congestion_control`: the lab adds it there if missing
and puts the list back on close.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DELAYER_SRC = ROOT / "tools" / "netlab" / "delay.c"
PREFIX = "cbl"
SUBNET = "10.77.0"
QUEUE_S = 0.02
"""tbf's queue: how long a packet may wait in it at the shaped rate (deeper: dropped)."""
DELAYER_RT_PRIORITY = int(os.environ.get("NETLAB_DELAYER_RT", "50"))
"""The delayers run SCHED_FIFO at this priority (`chrt`; $NETLAB_DELAYER_RT, 0: the default
policy): a packet's release must not wait for a core. At the default policy, with both
cores busy with the ranks' compute, a delayer waited behind them. Probe (2 ranks at
1 Gbit/s + 1 ms, 35 steps each of 35 ms of compute, a 499 kB gloo all-reduce and a
one-float one; median step): 49.4-52.0 ms with the compute
a busy loop (4 runs) against 46.4-48.2 with it a sleep; delayers real-time, 45.9-46.2 busy
and 46.3-46.4 asleep (the formulas: 47.6). GASLoC's 499 kB exchange after 100 ms of busy
compute, the second rank 5 ms late (median on that rank, 3 runs): 6.0, 6.6, 10.4 ms;
real-time 5.8, 5.9, 6.1 (2a + S/b: 6.3). A NIC needs no core to pass a packet on
(docs/network-model.md, "Validation on shaped links")."""
ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
AVAILABLE_CC = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")


def missing_requirements() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc", "iptables", "gcc", "chrt"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (tools/netlab/setup.sh installs it)"
    if not Path("/usr/include/libnetfilter_queue/libnetfilter_queue.h").exists():
        return "needs libnetfilter-queue-dev (tools/netlab/setup.sh installs it)"
    return None


def build_delayer(out_dir: Path) -> Path:
    exe = Path(out_dir) / "netlab-delay"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(DELAYER_SRC),
                    "-lnetfilter_queue"], check=True, capture_output=True, text=True)
    return exe


TBF_MIN_BURST_B = 2 * 1514
"""Two full frames: tbf's smallest bucket that passes every frame."""


def tbf_burst_b(rate_mbit: float) -> int:
    """tbf's bucket: rate x 1 ms at 1 Gbit/s and above (smaller ones under-deliver there:
    a 0.25 ms bucket carried 8 MiB at 77% of 1 Gbit/s), two frames below it.

    After an idle gap the bucket lets its bytes through at the veth's own speed, which a
    real link does not: each message then arrives about burst / rate early. At 100 Mbit/s a
    1 ms bucket made every 16 kB-2 MiB message after 20 ms of idle 0.7-1.0 ms faster than
    the link's alpha + S/beta; two frames (0.24 ms) 0.2-0.4 ms, at full rate on 2 MiB. At
    1 Gbit/s the veth and the delayer drain the 1 ms bucket little faster than the rate:
    128 kB-8 MiB within 0.2 ms of the formula (docs/network-model.md, "Validation on
    shaped links")."""
    return int(rate_mbit * 1e6 / 8 * 1e-3) if rate_mbit >= 1000 else TBF_MIN_BURST_B


def tbf(ns: str, dev: str, rate_mbit: float) -> list[str]:
    """tc's command setting `dev`'s root qdisc in namespace `ns` to a tbf of `rate_mbit`:
    burst `tbf_burst_b`, queue `QUEUE_S`."""
    return ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
            f"{rate_mbit}mbit", "burst", str(tbf_burst_b(rate_mbit)), "latency",
            f"{QUEUE_S * 1e3:g}ms"]


def switch(lab: dict, shaped: bool) -> None:
    """Put every rank's tbf of `lab` (`Lab.description`) on, both ways, or take it off
    (rate 0: never shaped). The delays stay: the in-run A/B switches the rate only
    (tests/netlab/traced.py). Root, from any namespace."""
    for i, rate in enumerate(lab["rates_mbit"]):
        if rate <= 0:
            continue
        for ns, dev in ((lab["namespaces"][i], "lab0"), (lab["switch"], f"p{i}")):
            if shaped:
                _sh(*tbf(ns, dev, rate))
            else:
                _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")


def _sh(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


class Lab:
    """The namespaces, links and delayers of one shaped network (a context manager)."""

    def __init__(self, rates_mbit: list[float], delays_ms: list[float], delayer: Path,
                 congestion_control: str = "cubic", shaped: bool = True):
        if len(rates_mbit) != len(delays_ms) or not rates_mbit:
            raise ValueError(f"one rate and one delay per rank, got {rates_mbit}, {delays_ms}")
        self.rates, self.delays, self.delayer = list(rates_mbit), list(delays_ms), delayer
        self.cc = congestion_control
        self.shaped = shaped
        """False: built without the tbf (the delays on), to be shaped by `switch` (the
        in-run A/B, tests/netlab/traced.py)."""
        self.n = len(rates_mbit)
        self.procs: list[subprocess.Popen] = []
        self._allowed_before: str | None = None

    def ns(self, i: int) -> str:
        return f"{PREFIX}-{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Lab:
        self.close()  # leftovers of an interrupted earlier run
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _allow_cc(self) -> None:
        available = AVAILABLE_CC.read_text().split()
        if self.cc not in available:
            raise RuntimeError(f"TCP congestion control {self.cc!r} is not available here "
                               f"(available: {available}); set NETLAB_CC to one of them")
        allowed = ALLOWED_CC.read_text().split()
        if self.cc not in allowed:
            self._allowed_before = " ".join(allowed)
            ALLOWED_CC.write_text(" ".join([*allowed, self.cc]))

    def _build(self) -> None:
        self._allow_cc()
        sw = f"{PREFIX}-sw"
        _sh("ip", "netns", "add", sw)
        _sh("ip", "link", "add", "br0", "type", "bridge", ns=sw)
        _sh("ip", "link", "set", "br0", "up", ns=sw)
        for i in range(self.n):
            ns = self.ns(i)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "set", "lo", "up", ns=ns)
            _sh("sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.cc}", ns=ns)
            _sh("ip", "link", "add", "lab0", "netns", ns, "type", "veth", "peer", "name",
                f"p{i}", "netns", sw)
            _sh("ip", "link", "set", f"p{i}", "master", "br0", ns=sw)
            _sh("ip", "link", "set", f"p{i}", "up", ns=sw)
            _sh("ip", "addr", "add", f"{self.addr(i)}/24", "dev", "lab0", ns=ns)
            _sh("ip", "link", "set", "lab0", "up", ns=ns)
            if self.delays[i] > 0:
                _sh("iptables", "-A", "INPUT", "-i", "lab0", "-j", "NFQUEUE", "--queue-num",
                    "0", ns=ns)
                rt = ["chrt", "-f", str(DELAYER_RT_PRIORITY)] if DELAYER_RT_PRIORITY else []
                self.procs.append(subprocess.Popen(
                    [*rt, "ip", "netns", "exec", ns, str(self.delayer), "0",
                     str(self.delays[i] * 1000)], stderr=subprocess.DEVNULL))
        if self.shaped:
            switch(self.description(), True)

    def description(self) -> dict:
        """What `switch` needs to shape or unshape the links from another process (a
        rank's, inside its namespace): JSON-able."""
        return {"namespaces": [self.ns(i) for i in range(self.n)], "switch": f"{PREFIX}-sw",
                "rates_mbit": self.rates}

    def popen(self, i: int, cmd: list[str], env: dict, **kw) -> subprocess.Popen:
        """Start `cmd` inside rank i's namespace (env passed through `env`)."""
        pairs = [f"{k}={v}" for k, v in env.items()]
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), "env", *pairs, *cmd], **kw)

    def emulation_cpu_s(self) -> float:
        """CPU seconds spent so far on emulating the links: the delayers' own (user +
        system) plus the host's interrupt and softirq time (tbf, the bridge, NFQUEUE; the
        whole host's, so read it with nothing else running). On 2 cores this is taken
        from the ranks' compute, which a real network would not do (docs/network-model.md,
        Results)."""
        tck = os.sysconf("SC_CLK_TCK")
        ticks = 0
        for p in self.procs:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return (ticks + int(cpu[6]) + int(cpu[7])) / tck  # + irq, softirq

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()
        listed = _sh("ip", "netns", "list", check=False).stdout.split()
        for name in listed:
            if name == f"{PREFIX}-sw" or (name.startswith(f"{PREFIX}-") and
                                          name[len(PREFIX) + 1:].isdigit()):
                _sh("ip", "netns", "del", name, check=False)
        if self._allowed_before is not None:
            ALLOWED_CC.write_text(self._allowed_before)
            self._allowed_before = None
