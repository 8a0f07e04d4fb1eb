/* netlab's delay line: packets read from TUN devices are written back to the same device after a delay.
 *
 *     delay_line TUN:DELAY_US:JITTER_US:SEED [TUN:...]
 *
 * Each TUN device (created beforehand with `ip tuntap add ... mode tun`, in the namespace this runs in) is
 * one line. Policy routing sends what a peer uploads into its line; what the line writes back re-enters the
 * router's stack from the TUN device and is routed on to its destination (delay.py sets this up).
 *
 * A packet is due DELAY_US after it arrived, plus a uniform jitter in [-JITTER_US, +JITTER_US], but never
 * before the packet ahead of it: a line is FIFO, like a real path, so jitter delays and never reorders
 * (reordering would read as loss to TCP, which a path of one hop does not do). A line holds at most
 * MAX_QUEUE_BYTES; beyond that it drops, like a full router buffer, and counts the drops.
 *
 * It runs at nice -10 where it may (root): a wire's delay must not grow with the load of the peers on the
 * machine, and a line that waits for a busy core adds that wait to every packet's round trip.
 *
 * Prints "ready" once every device is attached; exits 0 on SIGTERM / SIGINT, printing its counters.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAX_LINES 256
#define MAX_PACKET 65536
#define MAX_QUEUE_BYTES (64u << 20)

typedef struct packet {
    struct packet *next;
    uint64_t due_ns;
    size_t len;
    unsigned char data[];
} packet;

typedef struct {
    const char *name;
    int fd;
    uint64_t delay_ns, jitter_ns, last_due_ns, rng;
    packet *head, *tail;
    size_t queued_bytes;
    unsigned long long forwarded, dropped;
} line;

static volatile sig_atomic_t stopping = 0;

static void on_signal(int sig) { (void)sig; stopping = 1; }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t next_random(line *l) { /* xorshift64: jitter needs no more */
    l->rng ^= l->rng << 13;
    l->rng ^= l->rng >> 7;
    l->rng ^= l->rng << 17;
    return l->rng;
}

static int attach(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) { perror("delay_line: /dev/net/tun"); exit(2); }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) { fprintf(stderr, "delay_line: attach %s: %s\n", name, strerror(errno)); exit(2); }
    return fd;
}

static void enqueue(line *l, const unsigned char *data, size_t len, uint64_t now) {
    if (l->queued_bytes + len > MAX_QUEUE_BYTES) { l->dropped++; return; }
    packet *p = malloc(sizeof(packet) + len);
    if (!p) { l->dropped++; return; }
    int64_t jitter = 0;
    if (l->jitter_ns) jitter = (int64_t)(next_random(l) % (2 * l->jitter_ns + 1)) - (int64_t)l->jitter_ns;
    int64_t due = (int64_t)(now + l->delay_ns) + jitter;
    if (due < (int64_t)now) due = (int64_t)now;
    p->due_ns = (uint64_t)due > l->last_due_ns ? (uint64_t)due : l->last_due_ns;
    l->last_due_ns = p->due_ns;
    p->len = len;
    p->next = NULL;
    memcpy(p->data, data, len);
    if (l->tail) l->tail->next = p; else l->head = p;
    l->tail = p;
    l->queued_bytes += len;
}

/* Writes every due packet; returns the due time of the next one (UINT64_MAX: none). */
static uint64_t release(line *l, uint64_t now) {
    while (l->head && l->head->due_ns <= now) {
        packet *p = l->head;
        if (write(l->fd, p->data, p->len) < 0 && errno == EAGAIN) return now + 100000; /* retry in 0.1 ms */
        l->forwarded++;
        l->head = p->next;
        if (!l->head) l->tail = NULL;
        l->queued_bytes -= p->len;
        free(p);
    }
    return l->head ? l->head->due_ns : UINT64_MAX;
}

int main(int argc, char **argv) {
    static line lines[MAX_LINES];
    static struct pollfd fds[MAX_LINES];
    static unsigned char buffer[MAX_PACKET];
    int n = argc - 1;
    if (n < 1 || n > MAX_LINES) { fprintf(stderr, "usage: delay_line TUN:DELAY_US:JITTER_US:SEED ...\n"); return 2; }
    for (int i = 0; i < n; i++) {
        char *spec = argv[i + 1];
        char *name = strtok(spec, ":"), *delay = strtok(NULL, ":"), *jitter = strtok(NULL, ":"), *seed = strtok(NULL, ":");
        if (!name || !delay || !jitter || !seed) { fprintf(stderr, "delay_line: bad line spec\n"); return 2; }
        lines[i] = (line){.name = name, .delay_ns = strtoull(delay, NULL, 10) * 1000ull,
                          .jitter_ns = strtoull(jitter, NULL, 10) * 1000ull, .rng = strtoull(seed, NULL, 10) | 1};
        lines[i].fd = attach(name);
        fds[i] = (struct pollfd){.fd = lines[i].fd, .events = POLLIN};
    }
    (void)setpriority(PRIO_PROCESS, 0, -10); /* best effort: without root the line keeps its niceness */
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGINT, &action, NULL);
    printf("ready\n");
    fflush(stdout);
    while (!stopping) {
        uint64_t now = now_ns(), next = UINT64_MAX;
        for (int i = 0; i < n; i++) {
            uint64_t due = release(&lines[i], now);
            if (due < next) next = due;
        }
        struct timespec wait = {1, 0};
        if (next != UINT64_MAX) {
            uint64_t left = next > now ? next - now : 0;
            wait.tv_sec = left / 1000000000ull;
            wait.tv_nsec = left % 1000000000ull;
        }
        if (ppoll(fds, n, &wait, NULL) <= 0) continue;
        now = now_ns();
        for (int i = 0; i < n; i++) {
            if (!(fds[i].revents & POLLIN)) continue;
            for (;;) {
                ssize_t got = read(lines[i].fd, buffer, sizeof buffer);
                if (got <= 0) break;
                enqueue(&lines[i], buffer, (size_t)got, now);
            }
        }
    }
    for (int i = 0; i < n; i++)
        printf("%s forwarded %llu dropped %llu\n", lines[i].name, lines[i].forwarded, lines[i].dropped);
    return 0;
}
