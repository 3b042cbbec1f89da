"""Starting torchrun: its command line, whether this machine can host it, and waiting for
its ranks with bounded patience. What `commbench run` (bench/launch/run.py) and `commbench
netprobe` (bench/node/netprobe.py) start.

`python -m bench.launch.torchrun ARGS` (what `commbench run` starts, never torchrun itself) is
`torchrun ARGS`, except that it ignores the stop signals and dies with the launcher.
torchrun's own handling of SIGINT, SIGTERM and SIGHUP sends them to the ranks and kills
them 30 s later, which can cut a checkpoint short; the launcher relays the stop signals to
the ranks itself (bench/run/stop.py), so torchrun ignores them, and so do the ranks until
bench/run/train.py installs their handlers. SIGUSR1/2 (Slurm's warning before a time limit)
would kill torchrun. It dies with the launcher (and the ranks with it, bench/run/train.py):
a killed sweep leaves nothing training into a record that the next sweep resumes.

torchrun's own timeouts do not bound every wait before its ranks start: a rendezvous
endpoint that accepts connections but never answers, or a machine whose loopback is down
(`--standalone` rendezvous on localhost), keeps it retrying for many minutes without a
word. So the caller says what it waits for at once, each rank prints `STARTED` first
thing (torchrun starts the ranks once the rendezvous is complete; the rank's half,
`announce_start`, is bench/run/stop.py), and a torchrun whose
ranks have not started within `start_timeout_s` is stopped: the caller reports a
rendezvous that did not complete, naming the endpoint and the setting that bounds it.

The options `command` sets, which `launch.torchrun_args` may not hold: bench/config/checks.py
`SET_BY_COMMBENCH`, checked when the config is read.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from bench.run.stop import STARTED, STOP_SIGNALS, die_with_parent


def command(module: str, module_args: Sequence[str], nproc_per_node: int, nnodes: int = 1,
            rdzv_endpoint: str | None = None, rdzv_id: str = "commbench",
            rdzv_timeout_s: float = 600.0, extra: Sequence[str] = (),
            launcher: str = "torch.distributed.run") -> list[str]:
    """`python -m LAUNCHER ... -m MODULE ARGS` (torchrun, or `bench.launch.torchrun`: torchrun
    without its signal handling): standalone on one node without an endpoint, else a c10d
    rendezvous at `rdzv_endpoint` that every node joins within `rdzv_timeout_s`."""
    cmd = [sys.executable, "-m", launcher, f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("a rendezvous endpoint (host:port) is required with more than "
                             "one node")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}", f"--rdzv-conf=join_timeout={int(rdzv_timeout_s)}"]
    return cmd + list(extra) + ["-m", module, *module_args]


def check_loopback() -> None:
    """ValueError unless a TCP connection to this machine's loopback works: torchrun's
    standalone rendezvous (one node) and the ranks' process group meet on localhost, and
    without it they retry for minutes, silently."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError as err:
        raise ValueError(
            f"this machine's loopback (127.0.0.1) does not work ({err.strerror or err}): "
            "torchrun's rendezvous and the ranks' process group on one node meet there; "
            "bring the loopback interface up (ip link set lo up)") from None


NOT_STARTED, TIMED_OUT = "not started", "timed out"
"""Why `run` stopped torchrun."""


def run(cmd: list[str], env: dict, on_line: Callable[[str], None], start_timeout_s: float,
        timeout_s: float | None = None,
        relay: Callable[[subprocess.Popen], contextlib.AbstractContextManager] | None = None
        ) -> tuple[int, str | None]:
    """Run torchrun, handing each output line to `on_line` (but the ranks' STARTED lines).
    Returns (exit code, None), or (exit code, NOT_STARTED) when it was stopped because no
    rank started within `start_timeout_s`, (exit code, TIMED_OUT) when it ran past
    `timeout_s` in all. KeyboardInterrupt stops torchrun and is re-raised. With `relay`
    (the launcher's stop relay, bench/run/stop.py: entered with the process while it runs)
    `cmd` is `bench.launch.torchrun`, which ignores the stop signals: stopping it kills it (its
    ranks die with it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True, bufsize=1)
    started, why = threading.Event(), []
    at_once = relay is not None

    def give_up(reason: str) -> None:
        if reason == TIMED_OUT or not started.is_set():
            why.append(reason)
            stop(proc, at_once)

    timers = [threading.Timer(start_timeout_s, give_up, (NOT_STARTED,))]
    if timeout_s is not None:
        timers.append(threading.Timer(timeout_s, give_up, (TIMED_OUT,)))
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        with relay(proc) if relay is not None else contextlib.nullcontext():
            for line in proc.stdout:
                if line.startswith(STARTED):
                    started.set()
                else:
                    on_line(line)
            rc = proc.wait()
    except KeyboardInterrupt:
        stop(proc, at_once)
        raise
    finally:
        for timer in timers:
            timer.cancel()
    return rc, (why[0] if why else None)


def stop(proc: subprocess.Popen, at_once: bool = False, grace_s: float = 30.0) -> None:
    """SIGTERM (torchrun stops its ranks), then SIGKILL after `grace_s`; SIGKILL at once
    when `at_once` (`bench.launch.torchrun` ignores SIGTERM; its ranks die with it)."""
    if not at_once:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()


def main(argv: list[str]) -> None:
    """`python -m bench.launch.torchrun ARGS`: torchrun ARGS, ignoring the stop signals and dying
    with its parent (module docstring)."""
    for signum in STOP_SIGNALS:  # inherited by the ranks, which install their own handlers
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent()
    from torch.distributed.run import main as torchrun

    torchrun(["--signals-to-handle=SIGQUIT", *argv])  # not one of ours: torchrun's own


if __name__ == "__main__":
    main(sys.argv[1:])
