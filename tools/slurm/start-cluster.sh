#!/usr/bin/env bash
# A Slurm cluster on this host, without systemd, for tests/slurm (tox -e slurm): this host
# as one node, and two more nodes in network namespaces.
#
#   sudo tools/slurm/start-cluster.sh     # installs and starts; ~20 s once installed
#   sinfo -N                              # <host>: debug*, preempt, urgent; cbnode1-2: pair
#   sudo tools/slurm/stop-cluster.sh      # stops it all, removes the namespaces
#
# It installs Debian's slurm-wlm and munge (apt-get update first), plus slurmdbd and
# MariaDB: submitit reads the state of a job that ended without a result (cancelled,
# timed out) through `sacct`, which needs the accounting database. Then it writes
# slurm.conf for this host (its CPUs and memory from `slurmd -C`), starts munged,
# mariadbd, slurmdbd, slurmctld and slurmd as plain daemons, and waits for the nodes
# to be idle. Running it again while the cluster is up does nothing.
#
# Nodes and partitions:
#   <host>     debug (default); preempt (PreemptMode=REQUEUE, GraceTime 30 s) whose jobs
#              a job of urgent (a higher PriorityTier) preempts: a preemptible partition
#   cbnode1-2  pair: two nodes, each a network namespace with its own hostname (a UTS
#              namespace for its slurmd) and address (10.77.0.11-12 on the bridge cbslurm0;
#              this host is 10.77.0.1, where slurmctld listens), named in /etc/hosts.
#              Their jobs see only eth0 and lo: gloo binds eth0 (GLOO_SOCKET_IFNAME).
# Requeued jobs wait AuthInfo cred_expire (10 s here, 120 s by default) before they start
# again; KillWait 30 s (Slurm's default) is the time a stopped job has to checkpoint and
# close its attempt record before SIGKILL: 15 s was too short at load ~20 (issue 49).
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

NODES_NET=10.77.0        # the namespace nodes' subnet; this host is .1 on the bridge
BRIDGE=cbslurm0
MARK="# commbench tools/slurm"   # the /etc/hosts lines this script adds (stop removes them)

all_idle() { [ "$(sinfo -h -N -o %T 2>/dev/null | sort -u)" = idle ]; }

if [ "$(id -u)" != 0 ]; then
    echo "tools/slurm/start-cluster.sh must run as root (it installs packages and starts daemons)" >&2
    exit 1
fi

if command -v sinfo >/dev/null && all_idle && [ "$(sinfo -h -N | wc -l)" -ge 3 ]; then
    log "already up: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"
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
for cmd in ip unshare nsenter; do
    command -v "$cmd" >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 util-linux
done

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

# ------------------------------------------------------- the two namespace nodes' network
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "bridge $BRIDGE ($NODES_NET.1) and namespaces cbnode1, cbnode2"
    ip link add "$BRIDGE" type bridge
    ip addr add "$NODES_NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
fi
for i in 1 2; do
    ns=cbnode$i
    if ! ip netns list | grep -qw "$ns"; then
        ip netns add "$ns"
        ip link add "cbveth$i" type veth peer name eth0 netns "$ns"
        ip link set "cbveth$i" master "$BRIDGE" up
        ip -n "$ns" addr add "$NODES_NET.1$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    fi
    grep -q "^$NODES_NET.1$i $ns " /etc/hosts || echo "$NODES_NET.1$i $ns $MARK" >> /etc/hosts
done

# ------------------------------------------------------------------------ slurm.conf
node_line=$(slurmd -C | head -n1)   # NodeName=<host> CPUs=.. ... RealMemory=..
cat > "$CONF_DIR/slurm.conf" <<EOF
# Written by tools/slurm/start-cluster.sh: three nodes, root, no cgroups, no systemd.
ClusterName=$CLUSTER
SlurmctldHost=$host($NODES_NET.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
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
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# Short waits, so that cancelled and timed-out test jobs end quickly, yet a stopped job
# has time to save its checkpoint.
KillWait=30
OverTimeLimit=0
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
${node_line/NodeName=$host/NodeName=cbnode1} NodeAddr=$NODES_NET.11 State=UNKNOWN
${node_line/NodeName=$host/NodeName=cbnode2} NodeAddr=$NODES_NET.12 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF
PartitionName=preempt Nodes=$host MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=30
PartitionName=urgent Nodes=$host MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
PartitionName=pair Nodes=cbnode1,cbnode2 MaxTime=INFINITE State=UP PreemptMode=OFF
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
mkdir -p /var/spool/slurmd/"$host" /var/spool/slurmd/cbnode1 /var/spool/slurmd/cbnode2
if ! [ -s "/run/slurmd-$host.pid" ] || ! kill -0 "$(cat "/run/slurmd-$host.pid")" 2>/dev/null; then
    log "starting slurmd ($host)"
    slurmd
fi
for i in 1 2; do
    pid_file=/run/slurmd-cbnode$i.pid
    if ! [ -s "$pid_file" ] || ! kill -0 "$(cat "$pid_file")" 2>/dev/null; then
        log "starting slurmd (cbnode$i, in its namespace)"
        # nsenter, not `ip netns exec`, which remounts /sys and hides /sys/fs/cgroup
        nsenter --net="/var/run/netns/cbnode$i" unshare --uts \
            sh -c "hostname cbnode$i && exec slurmd"
    fi
done
for node in "$host" cbnode1 cbnode2; do
    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
done
wait_for 60 "every node to be idle" all_idle
wait_for 30 "sacct" sacct -n -X
log "up: $(sinfo -h -N -o '%N %P %T' | tr '\n' ' ')"
