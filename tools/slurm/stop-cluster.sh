#!/usr/bin/env bash
# Stops the cluster that tools/slurm/start-cluster.sh started (its daemons, by their pid
# files: nothing else is signalled) and removes its namespaces, bridge and /etc/hosts
# lines; installed packages and the database's files stay.
#   sudo tools/slurm/stop-cluster.sh
set -uo pipefail

stop() {  # stop NAME PIDFILE: the process whose pid the file holds, then wait for it
    local pid
    [ -s "$2" ] || return 0
    pid=$(cat "$2")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        echo "stopped $1 ($pid)" >&2
    fi
    rm -f "$2"
}

for pid_file in /run/slurmd-*.pid; do
    [ -e "$pid_file" ] && stop "slurmd ${pid_file#/run/slurmd-}" "$pid_file"
done
stop slurmctld /run/slurmctld.pid
stop slurmdbd /run/slurmdbd.pid
mysqladmin shutdown 2>/dev/null && echo "stopped mariadbd" >&2
stop munged /run/munge/munged.pid

for i in 1 2; do
    ip netns delete "cbnode$i" 2>/dev/null && echo "removed namespace cbnode$i" >&2
done
ip link delete cbslurm0 2>/dev/null && echo "removed bridge cbslurm0" >&2
sed -i '/# commbench tools\/slurm$/d' /etc/hosts
