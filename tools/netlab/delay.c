/* netlab-delay: hold every packet of an NFQUEUE for a fixed time, then accept it.
 *
 *     netlab-delay QUEUE_NUM DELAY_US
 *
 * The one-way latency of the shaped-link lab (tests/netlab, docs/network-model.md): this
 * kernel has no sch_netem, so each namespace sends its received packets
 * (iptables -A INPUT -i LAB_IF -j NFQUEUE --queue-num QUEUE_NUM) here. Delaying on the
 * RECEIVE side keeps TCP Small Queues on the sender out of it. The delay is constant, so a
 * FIFO keeps the release order. Runs until SIGTERM/SIGINT.
 * Build: gcc -O2 -o netlab-delay delay.c -lnetfilter_queue
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#define CAP (1 << 18)

static uint32_t ids[CAP];
static uint64_t due[CAP];
static size_t head, tail;
static uint64_t delay_ns;
static volatile sig_atomic_t stop;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa,
                     void *data) {
    (void)msg; (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph) return 0;
    uint32_t id = ntohl(ph->packet_id);
    if (tail - head >= CAP) /* full: let it through now rather than drop */
        return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
    ids[tail % CAP] = id;
    due[tail % CAP] = now_ns() + delay_ns;
    tail++;
    return 0;
}

static void on_signal(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s QUEUE_NUM DELAY_US\n", argv[0]);
        return 2;
    }
    int queue = atoi(argv[1]);
    delay_ns = (uint64_t)(atof(argv[2]) * 1000.0);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    struct nfq_handle *h = nfq_open();
    if (!h) { perror("nfq_open"); return 1; }
    struct nfq_q_handle *qh = nfq_create_queue(h, queue, &on_packet, NULL);
    if (!qh) { perror("nfq_create_queue"); return 1; }
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) { perror("nfq_set_mode"); return 1; }
    nfq_set_queue_maxlen(qh, CAP);
    int fd = nfq_fd(h);
    int one = 1, rcvbuf = 64 << 20;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf);
    char buf[65536] __attribute__((aligned));
    fprintf(stderr, "netlab-delay: queue %d, %.0f us\n", queue, delay_ns / 1e3);
    while (!stop) {
        /* ppoll sleeps with nanosecond resolution (hrtimers) until the head is due */
        struct timespec wait = {0, 100000000}; /* nothing held: wake every 100 ms */
        if (head != tail) {
            uint64_t t = now_ns(), d = due[head % CAP], left = d > t ? d - t : 0;
            wait.tv_sec = (time_t)(left / 1000000000ull);
            wait.tv_nsec = (long)(left % 1000000000ull);
        }
        struct pollfd p = {fd, POLLIN, 0};
        int r = ppoll(&p, 1, &wait, NULL);
        if (r > 0 && (p.revents & POLLIN)) {
            int n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            while (n > 0) {
                nfq_handle_packet(h, buf, n);
                n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            }
        }
        uint64_t t = now_ns();
        while (head != tail && due[head % CAP] <= t) {
            nfq_set_verdict(qh, ids[head % CAP], NF_ACCEPT, 0, NULL);
            head++;
        }
    }
    while (head != tail) { /* release what is held before leaving */
        nfq_set_verdict(qh, ids[head % CAP], NF_ACCEPT, 0, NULL);
        head++;
    }
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}
