"""torchrun as the launcher starts it: `python -m bench.torchrun ARGS` is `torchrun ARGS`,
except that it ignores the stop signals and dies with the launcher.

    commbench run configs/ddp-tiny.yaml     # bench/launch.py starts this, never torchrun

torchrun's own handling of SIGINT, SIGTERM and SIGHUP sends them to the ranks and kills
them 30 s later, which can cut a checkpoint short; the launcher relays the stop signals to
the ranks itself (bench/stop.py), so torchrun ignores them, and so do the ranks until
bench/train.py installs their handlers. SIGUSR1/2 (Slurm's warning before a time limit)
would kill torchrun. It dies with the launcher (and the ranks with it, bench/train.py):
a killed sweep leaves nothing training into a record that the next sweep resumes.
"""

from __future__ import annotations

import signal
import sys

from bench.stop import STOP_SIGNALS, die_with_parent


def main(argv: list[str]) -> None:
    for signum in STOP_SIGNALS:  # inherited by the ranks, which install their own handlers
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent()
    from torch.distributed.run import main as torchrun

    torchrun(["--signals-to-handle=SIGQUIT", *argv])  # not one of ours: torchrun's own


if __name__ == "__main__":
    main(sys.argv[1:])
