#!/usr/bin/env bash
# A one-node Slurm cluster on this host, without systemd, for tests/slurm (tox -e slurm).
#
#   sudo tools/slurm/start-cluster.sh     # installs and starts; ~15 s once installed
#   sinfo                                 # debug* up infinite 1 idle <host>
#   sudo tools/slurm/stop-cluster.sh
#
# It installs Debian's slurm-wlm and munge (apt-get update first), plus slurmdbd and
# MariaDB: submitit reads the state of a job that ended without a result (cancelled,
# timed out) through `sacct`, which needs the accounting database. Then it writes
# slurm.conf for this host (its CPUs and memory from `slurmd -C`), starts munged,
# mariadbd, slurmdbd, slurmctld and slurmd as plain daemons, and waits for the node
# to be idle. Running it again while the cluster is up does nothing.
# Logs: /var/log/slurm/*.log. State: /var/spool/slurm*. Needs root (Debian/Ubuntu).
set -euo pipefail

CLUSTER=commbench
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
DB_PASS=commbench-test   # local socket-only test database; not a secret

log() { echo "[slurm-cluster] $*" >&2; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    for _ in $(seq "$limit"); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    log "timed out after ${limit}s waiting for $what; logs in $LOG_DIR"
    tail -n 20 "$LOG_DIR"/*.log >&2 || true
    exit 1
}

node_idle() { [ "$(sinfo -h -N -o %T 2>/dev/null | head -n1)" = idle ]; }

if [ "$(id -u)" != 0 ]; then
    echo "tools/slurm/start-cluster.sh must run as root (it installs packages and starts daemons)" >&2
    exit 1
fi

if command -v sinfo >/dev/null && node_idle; then
    log "already up: $(sinfo -h -N -o '%N %T')"
    exit 0
fi

missing=0
for cmd in slurmctld slurmd slurmdbd sacct munged mariadbd; do
    command -v "$cmd" >/dev/null || missing=1
done
if [ "$missing" = 1 ]; then
    log "installing slurm-wlm, munge, slurmdbd, mariadb-server"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge slurmdbd mariadb-server
fi

host=$(hostname -s)
mkdir -p "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd /run/munge /run/mysqld

# ---------------------------------------------------------------------------- munge
[ -s /etc/munge/munge.key ] || mungekey --create --force
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    wait_for 10 munged sh -c 'munge -n | unmunge'
fi

# ------------------------------------------------------------ MariaDB + slurmdbd
chown mysql:mysql /run/mysqld
if ! mysqladmin ping >/dev/null 2>&1; then
    log "starting mariadbd"
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
    setsid mariadbd --user=mysql >"$LOG_DIR/mariadb.log" 2>&1 < /dev/null &
    wait_for 30 mariadbd mysqladmin ping
fi
mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
          CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

cat > "$CONF_DIR/slurmdbd.conf" <<EOF
# Written by tools/slurm/start-cluster.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$LOG_DIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
chmod 600 "$CONF_DIR/slurmdbd.conf"

# ------------------------------------------------------------------------ slurm.conf
node_line=$(slurmd -C | head -n1)   # NodeName=<host> CPUs=.. ... RealMemory=..
cat > "$CONF_DIR/slurm.conf" <<EOF
# Written by tools/slurm/start-cluster.sh: one node, root, no cgroups, no systemd.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# Short waits, so that cancelled and timed-out test jobs end quickly.
KillWait=5
OverTimeLimit=0
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

if ! pgrep -x slurmdbd >/dev/null; then
    log "starting slurmdbd"
    slurmdbd
fi
wait_for 30 slurmdbd sacctmgr -n list cluster
sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true

if ! pgrep -x slurmctld >/dev/null; then
    log "starting slurmctld"
    slurmctld
fi
wait_for 30 slurmctld scontrol ping
if ! pgrep -x slurmd >/dev/null; then
    log "starting slurmd"
    slurmd
fi
scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
wait_for 60 "node $host to be idle" node_idle
wait_for 30 "sacct" sacct -n -X
log "up: $(sinfo -h -N -o '%N %T'); partition $(sinfo -h -o %P)"
