#!/usr/bin/env bash
# Stops the one-node cluster that tools/slurm/start-cluster.sh started (its daemons,
# by their pid files or exact names); installed packages and the database stay.
#   sudo tools/slurm/stop-cluster.sh
set -uo pipefail

stop() {  # stop NAME [PIDFILE]
    local pid=""
    if [ -n "${2:-}" ] && [ -s "$2" ]; then pid=$(cat "$2"); fi
    [ -n "$pid" ] || pid=$(pgrep -x "$1" | head -n1)
    if [ -n "$pid" ]; then
        kill "$pid" 2>/dev/null && echo "stopped $1 ($pid)" >&2
    fi
}

stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
stop slurmdbd /run/slurmdbd.pid
mysqladmin shutdown 2>/dev/null && echo "stopped mariadbd" >&2
stop munged /run/munge/munged.pid
