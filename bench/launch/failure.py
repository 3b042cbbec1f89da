"""Why a run failed, in one headline that names the culprit rank (bench/launch/run.py uses it).

    COMMBENCH_FAULT=2:5:kill commbench run configs/ddp-tiny.yaml    # "rank 2: killed by SIGKILL"

When one rank dies, the others fail too, on the broken collective, often later and with a
longer traceback; the headline must name the first. The evidence, in order of trust:
1. torchrun's failure summary (its "rank : N (local_rank: ...)" / "exitcode : E" blocks):
   a rank that exited on a signal (kill -9, the OOM killer) left no traceback, and the
   others' errors are consequences of it. SIGTERM is what torchrun itself sends the
   survivors, so it counts only as torchrun's root cause and when no other signal shows;
2. the ranks' error files (logs/error-rankN.txt, bench/run/train.py writes them): an error
   that is not about a lost peer or a timeout is a cause; the first written wins;
3. only timeouts: the ranks that timed out waited in a collective for `parallel.timeout_s`
   for a rank that never arrived; the ranks with no error file are the frozen ones (with
   many ranks, a healthy rank that torchrun stopped before it timed out is listed too);
4. only lost peers: the ranks with no error file are gone without a word (their node
   died, or its processes were killed: another node's torchrun cannot see them).
Where the ranks' node records say (logs/nodeN.json, bench/run/train.py), a rank is named with
its host, so a lost node is named.
On NCCL a timeout leaves no error file: each waiting rank's watchdog logs "Watchdog
caught collective operation timeout" and aborts the process (SIGABRT), so torchrun's
first failure is a victim. Those ranks count as timed out (3), not as killed (1): the
headline names the rank that never arrived, not the first rank that gave up on it. The
watchdog's `Rank N` is the rank in the timed-out group; the global one is the line's
`[rankN]:` prefix.
"""

from __future__ import annotations

import contextlib
import re
import signal

from bench.run.files import read_json
from bench.run.records import RunDir

SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "ProcessGroupNCCL is aborted", "NCCL communicator was aborted",
             "Connection refused")
"""Error texts of a rank that failed because another one did."""
TIMEOUT = ("Timed out", "timed out", "Timeout", "timeout")
"""Error texts of a rank that waited for a collective past the process-group timeout."""

_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
_STOPPED = re.compile(r"Sending process (\d+) closing signal")
_WATCHDOG = re.compile(r"\[(?P<group>[^\[\]]*?)\s*Rank (?P<rank>\d+)\]\s*"
                       r"Watchdog caught collective operation timeout")
_GLOBAL_RANK = re.compile(r"\[rank(\d+)\]:")
"""ProcessGroupNCCL's line when a collective ran past the timeout on that rank: the line's
`[rankN]:` prefix (torch's C++ log, from RANK) is the global rank; `Rank N` in the bracket
is the rank within the timed-out process group ("PG ID 0" is the world)."""
_DEFAULT_GROUP = re.compile(r"PG ID 0\b")


def nccl_timeouts(lines: list[str]) -> set[int]:
    """The global ranks whose NCCL watchdog caught a collective timeout (then aborted them).
    A subgroup's rank (DiLoCo's cross-replica group, a pipeline pair) is not the global one:
    a line without the global prefix counts only when its group is the world."""
    ranks = set()
    for line in lines:
        if not (m := _WATCHDOG.search(line)):
            continue
        if prefix := _GLOBAL_RANK.search(line, 0, m.start()):
            ranks.add(int(prefix.group(1)))
        elif _DEFAULT_GROUP.search(m.group("group")):
            ranks.add(int(m.group("rank")))
    return ranks


def torchrun_failures(lines: list[str]) -> tuple[dict[int, int], int | None]:
    """(global rank -> exit code of each failed rank, the root cause's rank) from torchrun's
    ChildFailedError summary; ranks that torchrun itself stopped ("Sending process PID
    closing signal") are left out: they are not a cause."""
    failures, rank, root, in_root = {}, None, None, False
    stopped = {int(m.group(1)) for line in lines if (m := _STOPPED.search(line))}
    for line in lines:
        in_root = in_root or line.startswith("Root Cause")
        if m := _RANK.match(line):
            rank = int(m.group(1))
        elif (m := _EXIT.match(line)) and rank is not None:
            if int(m.group(2)) not in stopped:
                failures[rank] = int(m.group(1))
                root = rank if in_root and root is None else root
            rank = None
    return failures, root


def _killed(failures: dict[int, int], root: int | None) -> int | None:
    """The rank killed by a signal that is the cause (not torchrun's SIGTERM), or None."""
    by_signal = [r for r, code in sorted(failures.items())
                 if code < 0 and code != -signal.SIGTERM]
    if by_signal:
        return root if root in by_signal else by_signal[0]
    return root if root is not None and failures[root] < 0 else None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def _kind(text: str) -> str:
    if any(s in text for s in SECONDARY):
        return "secondary"
    if any(s in _headline(text) for s in TIMEOUT):
        return "timeout"
    return "cause"


def _headline(text: str) -> str:
    """The exception line of a traceback (the last `XxxError: ...`), else its last line;
    C++ errors append an "At:" stack after it."""
    lines = text.strip().splitlines()
    exceptions = [line for line in lines if _EXCEPTION.match(line)]
    return (exceptions or lines or ["unknown error"])[-1]


def _ranks(ranks: list[int], run: RunDir | None = None) -> str:
    """"rank 2" / "ranks 2, 3", with their hosts when `run` has node records."""
    text = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
    hosts = sorted({h for r in ranks if (h := host_of(run, r))}) if run is not None else []
    return text + (f" (node {', '.join(hosts)})" if hosts else "")


def host_of(run: RunDir, rank: int) -> str | None:
    """The host that rank `rank` ran on, from the node records, or None."""
    for path in run.node_records():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            record = read_json(path)
            if rank in record.get("ranks", []):
                return str(record["host"])
    return None


def error_text(run: RunDir, rc: int, tail: list[str], world_size: int,
               timeout_s: float) -> str:
    """The failed run's `error`: a headline naming the culprit, then its traceback's end."""
    errors = run.error_logs()  # first written first
    texts = {int(p.stem.removeprefix("error-rank")): p.read_text() for p in errors}
    order = list(texts)
    failures, root = torchrun_failures(tail)
    watchdog = nccl_timeouts(_log_lines(run, tail))
    aborted = {r for r, code in failures.items() if r in watchdog and code == -signal.SIGABRT}
    rank = _killed({r: c for r, c in failures.items() if r not in aborted},
                   None if root in aborted else root)
    if rank is not None:
        code = failures[rank]
        others = [r for r in order if r != rank]
        text = (f"{_ranks([rank], run)}: killed by {_signal_name(code)} (exit code {code}; no "
                "traceback: killed by hand, by the OOM killer or by the scheduler?)")
        if others:
            text += f" (then {_ranks(others)} failed too)"
        return text + "\n" + "\n".join(tail[-15:])
    kinds = {r: _kind(t) for r, t in texts.items()}
    causes = [r for r in order if kinds[r] == "cause"]
    timed_out = [r for r in order if kinds[r] == "timeout"]
    timed_out += sorted(watchdog - set(timed_out) - set(causes))
    silent = [r for r in range(world_size) if r not in texts and r not in watchdog]
    if not causes and timed_out:
        text = (f"{_ranks(sorted(timed_out))} timed out after {timeout_s:g} s "
                "(parallel.timeout_s) waiting in a collective"
                + (" (NCCL watchdog: aborted)" if watchdog else ""))
        if silent:
            text = (f"{_ranks(silent, run)} stopped responding (no error from it: frozen, "
                    "or stuck outside the collective); " + text)
        evidence = (_last(texts[timed_out[0]], 15) if timed_out[0] in texts
                    else [line for line in tail if _WATCHDOG.search(line)][-15:])
        return text + "\n" + "\n".join(evidence)
    if texts and not causes and silent:  # only lost peers: the silent ranks are gone
        return (f"{_ranks(silent, run)} lost: no error from them (their node died or their "
                f"processes were killed); {_ranks(order, run)} lost their peers\n"
                + "\n".join(_last(texts[order[0]], 15)))
    if texts:
        first = (causes or order)[0]
        lines = _last(texts[first], 15)
        text = f"rank {first}: {_headline(texts[first])}"
        others = [r for r in order if r != first]
        if others:
            text += f" (then {_ranks(others)} failed too)"
        return text + "\n" + "\n".join(lines)
    return f"torchrun exited with code {rc}\n" + "\n".join(tail[-15:])


def _log_lines(run: RunDir, tail: list[str]) -> list[str]:
    """Every line torchrun printed in the last attempt (the ranks' NCCL messages come
    before its summary and may have scrolled out of `tail`; the log holds earlier attempts
    too, each after its command line), or `tail` when the log is missing."""
    try:
        lines = run.torchrun_log.read_text(errors="replace").splitlines()
    except OSError:
        return tail
    starts = [i for i, line in enumerate(lines) if "torch.distributed.run" in line]
    return lines[starts[-1]:] if starts else lines


def _last(text: str, n: int) -> list[str]:
    return text.strip().splitlines()[-n:]

