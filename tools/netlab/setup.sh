#!/bin/sh
# Installs what the shaped-link lab needs (tox -e netlab runs this first; needs root):
# iproute2 (ip, tc), iptables (NFQUEUE rule), gcc and libnetfilter-queue-dev (the delayer,
# tools/netlab/delay.c, compiled by tests/netlab/lab.py). Debian/Ubuntu only.
set -e
if [ "$(id -u)" != 0 ]; then
    echo "netlab setup: not root, nothing installed (the tests will skip)" >&2
    exit 0
fi
missing=""
command -v ip >/dev/null && command -v tc >/dev/null || missing="$missing iproute2"
command -v iptables >/dev/null || missing="$missing iptables"
command -v gcc >/dev/null || missing="$missing gcc"
[ -f /usr/include/libnetfilter_queue/libnetfilter_queue.h ] || missing="$missing libnetfilter-queue-dev"
if [ -n "$missing" ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
fi
