// SPDX-License-Identifier: GPL-2.0
/* fabriclab's PFC sender: the frames the data path's programs decide but cannot
 * send themselves, sent from the switches' namespace as they come.
 *
 * A switch port's programs send its PFC frames at once (dataplane.bpf.c: a copy of
 * the frame in hand, turned into the PFC frame on the port's egress). An XON is
 * decided where the frame that frees the ingress leaves its queue, seen on the
 * far end of the link: on a GPU host's end that program runs in the host's
 * namespace, which cannot reach the switch's devices. It hands the decision over
 * (struct send_request on the `sends` ring) and this process, woken by it, sends
 * what the port's flag says now, if the port's last frame on the wire said
 * otherwise (the port's egress program counts the frame and notes it). Every XON is
 * handed over, sent or not (and an XOFF a program could not send), and each port told
 * of is looked at again RECHECK_NS later (at the next wake-up after that, at most
 * RECHECK_LATEST_MS): two decisions on two CPUs at once (an XOFF sent by a program,
 * an XON sent here or by another program) may put their frames on the wire in the
 * other order, and a frame still on its way in a program looks like no frame for a
 * moment.
 * A C process, not the controller app: a Python wake-up per XON cost ~80 us of CPU
 * (the lab's own CPU was most of it in the PFC incast); this costs a few.
 *
 *     pfc-sender PIN_DIR       (the maps pinned by lab/kernel/dataplane.py)
 * Exits on SIGTERM, or when the maps are gone.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/bpf.h>
#include <linux/if_packet.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>

#include "dataplane.h"

#define RINGBUF_BUSY (1U << 31)
#define RINGBUF_DISCARD (1U << 30)
#define RINGBUF_HDR 8
#define RECHECK_NS 1000000
/* A recheck waits for the next request's wake-up (one every ~2 ms in the incast), or
 * this long at most: a wake-up of its own per recheck was half this process's CPU */
#define RECHECK_LATEST_MS 5

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
	(void)sig;
	stop = 1;
}

static __u64 now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (__u64)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int bpf(int cmd, union bpf_attr *attr)
{
	return syscall(__NR_bpf, cmd, attr, sizeof(*attr));
}

static int pinned(const char *dir, const char *name, struct bpf_map_info *info)
{
	char path[4096];
	union bpf_attr attr;
	int fd;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	memset(&attr, 0, sizeof(attr));
	attr.pathname = (__u64)(unsigned long)path;
	fd = bpf(BPF_OBJ_GET, &attr);
	if (fd < 0) {
		fprintf(stderr, "pfc-sender: %s: %s\n", path, strerror(errno));
		exit(1);
	}
	memset(&attr, 0, sizeof(attr));
	memset(info, 0, sizeof(*info));
	attr.info.bpf_fd = fd;
	attr.info.info_len = sizeof(*info);
	attr.info.info = (__u64)(unsigned long)info;
	if (bpf(BPF_OBJ_GET_INFO_BY_FD, &attr) < 0) {
		fprintf(stderr, "pfc-sender: %s: %s\n", path, strerror(errno));
		exit(1);
	}
	return fd;
}

static void *map(int fd, size_t len, int prot, off_t off)
{
	void *p = mmap(NULL, len, prot, MAP_SHARED, fd, off);

	if (p == MAP_FAILED) {
		perror("pfc-sender: mmap");
		exit(1);
	}
	return p;
}

/* Make port `slot`'s last PFC frame for `prio` say what its XOFF flag says. */
static void follow(int sock, struct port *ports, __u32 n, __u32 slot, __u32 prio)
{
	struct port *p;
	struct prio_state *q;
	struct sockaddr_ll to;
	struct pfc f;
	__u32 xoff;

	if (slot >= n || !ports[slot].ifindex)
		return;
	p = &ports[slot];
	q = &p->q[prio & (PRIOS - 1)];
	xoff = __atomic_load_n(&q->xoff, __ATOMIC_ACQUIRE);
	if (xoff == __atomic_load_n(&q->wire_xoff, __ATOMIC_ACQUIRE))
		return;
	if (xoff && !p->pause_quanta)
		return;
	memset(&f, 0, sizeof(f));
	memcpy(f.dst, "\x01\x80\xc2\x00\x00\x01", ETH_ALEN);
	memcpy(f.src, p->mac, ETH_ALEN);
	f.type = htons(MAC_CONTROL);
	f.mc.opcode = htons(OPCODE_PFC);
	f.mc.enable = htons(1 << (prio & (PRIOS - 1)));
	f.mc.time[prio & (PRIOS - 1)] = htons(xoff ? p->pause_quanta : 0);
	memset(&to, 0, sizeof(to));
	to.sll_family = AF_PACKET;
	to.sll_protocol = htons(MAC_CONTROL);
	to.sll_ifindex = p->ifindex;
	to.sll_halen = ETH_ALEN;
	memcpy(to.sll_addr, f.dst, ETH_ALEN);
	if (sendto(sock, &f, sizeof(f), 0, (struct sockaddr *)&to, sizeof(to)) < 0 &&
	    errno != ENETDOWN && errno != ENXIO)     /* a link down: nothing to resume */
		fprintf(stderr, "pfc-sender: port slot %u: %s\n", slot, strerror(errno));
}

int main(int argc, char **argv)
{
	struct bpf_map_info ports_info, sends_info;
	long page = sysconf(_SC_PAGESIZE);
	struct epoll_event ev = {.events = EPOLLIN};
	int ports_fd, sends_fd, sock, ep, prio = HTB_DIRECT;
	unsigned long *consumer, *producer;
	struct port *ports;
	__u64 *due;             /* per (slot, priority): look again then (0: no need) */
	int rechecks = 0;
	__u8 *data;
	__u64 mask;

	if (argc != 2) {
		fprintf(stderr, "usage: pfc-sender PIN_DIR\n");
		return 2;
	}
	signal(SIGTERM, on_term);
	signal(SIGINT, on_term);
	ports_fd = pinned(argv[1], "ports", &ports_info);
	sends_fd = pinned(argv[1], "sends", &sends_info);
	if (ports_info.value_size != sizeof(struct port)) {
		fprintf(stderr, "pfc-sender: the ports map holds %u-byte ports, not %zu: built "
			"from another version of dataplane.h\n", ports_info.value_size,
			sizeof(struct port));
		return 1;
	}
	ports = map(ports_fd, (size_t)ports_info.max_entries * sizeof(struct port),
		    PROT_READ, 0);
	mask = sends_info.max_entries - 1;
	consumer = map(sends_fd, page, PROT_READ | PROT_WRITE, 0);
	producer = map(sends_fd, page + 2 * (size_t)sends_info.max_entries, PROT_READ, page);
	data = (__u8 *)producer + page;
	due = calloc((size_t)ports_info.max_entries * PRIOS, sizeof(*due));
	if (!due) {
		perror("pfc-sender: calloc");
		return 1;
	}
	sock = socket(AF_PACKET, SOCK_RAW, 0);      /* protocol 0: sends, receives nothing */
	if (sock < 0 || setsockopt(sock, SOL_SOCKET, SO_PRIORITY, &prio, sizeof(prio)) < 0) {
		perror("pfc-sender: packet socket");
		return 1;
	}
	ep = epoll_create1(0);
	if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, sends_fd, &ev) < 0) {
		perror("pfc-sender: epoll");
		return 1;
	}
	while (!stop) {
		unsigned long cons = __atomic_load_n(consumer, __ATOMIC_ACQUIRE);
		unsigned long prod = __atomic_load_n(producer, __ATOMIC_ACQUIRE);
		__u32 i;

		while (cons < prod) {
			__u32 *hdr = (__u32 *)(data + (cons & mask));
			__u32 len = __atomic_load_n(hdr, __ATOMIC_ACQUIRE);

			if (len & RINGBUF_BUSY)
				break;
			if (!(len & RINGBUF_DISCARD)) {
				struct send_request *r = (void *)((__u8 *)hdr + RINGBUF_HDR);

				follow(sock, ports, ports_info.max_entries, r->slot, r->prio);
				i = r->slot * PRIOS + (r->prio & (PRIOS - 1));
				if (r->slot < ports_info.max_entries && !due[i]) {
					due[i] = now_ns() + RECHECK_NS;
					rechecks++;
				}
			}
			len &= ~(RINGBUF_BUSY | RINGBUF_DISCARD);
			cons += (len + RINGBUF_HDR + 7) & ~7UL;
			__atomic_store_n(consumer, cons, __ATOMIC_RELEASE);
		}
		if (cons != prod)
			continue;
		if (epoll_wait(ep, &ev, 1, rechecks ? RECHECK_LATEST_MS : 1000) < 0 &&
		    errno != EINTR) {
			perror("pfc-sender: epoll_wait");
			return 1;
		}
		if (rechecks) {
			__u64 now = now_ns();

			for (i = 0; i < ports_info.max_entries * PRIOS; i++) {
				if (!due[i] || due[i] > now)
					continue;
				due[i] = 0;
				rechecks--;
				follow(sock, ports, ports_info.max_entries, i / PRIOS, i % PRIOS);
			}
		}
	}
	return 0;
}
