// SPDX-License-Identifier: GPL-2.0
/* fabriclab's per-packet switch port: ECN marking and the PFC trigger, in the kernel.
 *
 * Two tc programs per link end (lab/dataplane.py loads and attaches them):
 *   egress   on a switch port: every frame that enters the port's queues (the
 *            egress hook runs before the qdisc enqueues). It classifies the frame
 *            by DSCP as the port's u32 filters do, drops it when its priority's
 *            buffer is full (so every drop is counted here, and a frame counted
 *            as marked is a frame that is sent), marks CE with RED's probability
 *            of the average backlog, and signals XOFF the moment a lossless
 *            priority's backlog passes its threshold.
 *   ingress  on every link end: the frames the peer's queues sent (departures:
 *            the peer's backlog falls, XON when it passes below the resume
 *            threshold), and the PFC / PAUSE frames the peer's MAC sent (this
 *            port must stop: signalled at once to user space, which closes the
 *            port's gate).
 * A queue's backlog is what entered it minus what left it (both counted per
 * packet), not a sample. What leaves unseen (a queue flushed when its link goes
 * down) user space finds against the kernel's own backlog and writes off
 * (out_adjust). Events go to user space through a ring buffer; the
 * counters sit in one array, mapped into user space. Each program instance is
 * told its port's slot through read-only data (the loader fills it in).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define PRIOS 8
#define NO_SLOT 0xffffffff
#define MAC_CONTROL 0x8808
#define OPCODE_PAUSE 0x0001
#define OPCODE_PFC 0x0101
#define AVG_SHIFT 10            /* RED's average backlog in bytes << AVG_SHIFT */
#define EV_XOFF 1
#define EV_XON 2
#define EV_PAUSE_RX 3

/* lab/dataplane.py declares the same layouts (PORT, EVENT): change both together */
struct prio_cfg {
	__u32 limit_bytes;      /* the priority's buffer; a frame that does not fit is dropped */
	__u32 xoff_bytes;       /* 0: not lossless */
	__u32 xon_bytes;
	__u32 nic_honours;      /* 1: the NIC at this link end (a GPU agent's transport)
				 * stops this priority itself when a pause arrives: no gate */
};

struct prio_state {
	__u64 in_bytes;         /* admitted into the queue */
	__u64 out_bytes;        /* left it (seen on the peer's ingress) */
	__u64 in_packets;
	__u64 out_packets;
	__u64 drop_packets;
	__u64 drop_bytes;
	__u64 ce_marked;
	__u64 avg_scaled;       /* RED's average backlog << AVG_SHIFT */
	__u64 idle_since_ns;    /* when the queue last ran empty */
	__u64 xoff_signals;     /* XOFF / XON decisions signalled to user space */
	__u64 xon_signals;
	__u64 pfc_tx_pause;     /* PFC frames this port sent with this priority paused... */
	__u64 pfc_tx_resume;    /* ...or resumed (pause time 0) */
	__u64 pfc_rx_pause;     /* and received */
	__u64 pfc_rx_resume;
	__u64 rx_packets;       /* arrived on this port's ingress (into its switch) */
	__u64 rx_bytes;
	__u64 red_r;            /* RED: marks/packets threshold drawn at the last mark */
	__u64 out_adjust;       /* bytes user space found gone without being seen leaving */
	__u64 paused_until_ns;  /* a pause frame received holds this priority until then */
	__u32 xoff;             /* 1 while XOFF is signalled */
	__s32 red_count;        /* RED: packets since the last mark (-1: outside Kmin..Kmax) */
};

struct port {
	__u32 ecn_prio_mask;    /* priorities whose ECT frames may be marked CE */
	__u32 kmin_bytes;
	__u32 kmax_bytes;
	__u32 pmax_u32;         /* Pmax * 2^32 */
	__u32 wlog;             /* RED's EWMA weight: 2^-wlog */
	__u32 packet_ns;        /* an average packet's time on the link (idle decay) */
	__u32 quantum_ns;       /* a pause quantum (512 bit times) on this port's link */
	__u32 pad;
	__u8 dscp_prio[64];
	struct prio_cfg cfg[PRIOS];
	struct prio_state q[PRIOS];
};

struct event {
	__u64 t_ns;
	__u32 kind;
	__u32 slot;
	__u32 prio;
	__u32 value;            /* backlog (XOFF/XON), or the class-enable vector (PAUSE_RX) */
	__u16 quanta[PRIOS];    /* PAUSE_RX: pause time per priority */
};

_Static_assert(sizeof(struct port) == 1568, "lab/dataplane.py's PORT_BYTES");
_Static_assert(sizeof(struct event) == 40, "lab/dataplane.py's EVENT");

/* The maps: the loader creates them (no BTF needed) and binds these symbols. */
char ports[4] SEC("maps");
char events[4] SEC("maps");

volatile const __u32 port_slot = NO_SLOT;   /* this link end's own port */
volatile const __u32 peer_slot = NO_SLOT;   /* the port at the other end (ingress) */
volatile const __u32 switch_port = 0;       /* 1: a switch's MAC, which consumes pauses */

static __always_inline struct port *port_at(__u32 slot)
{
	if (slot == NO_SLOT)
		return 0;
	return bpf_map_lookup_elem(&ports, &slot);
}

/* The frame's priority, as the port's u32 filters pick its class: DSCP of IPv4. */
static __always_inline int classify(struct __sk_buff *skb, struct port *p, struct iphdr **ip_out)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip;

	*ip_out = 0;
	if ((void *)(eth + 1) > end)
		return 0;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return 0;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return 0;
	*ip_out = ip;
	return p->dscp_prio[(ip->tos >> 2) & 63] & (PRIOS - 1);
}

static __always_inline __u64 backlog_of(struct prio_state *q)
{
	__u64 in = q->in_bytes, out = q->out_bytes + q->out_adjust;

	return in > out ? in - out : 0;
}

static __always_inline void notify(__u32 kind, __u32 slot, __u32 prio, __u32 value)
{
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);

	if (!e)
		return;     /* user space is far behind; the counters still say it */
	__builtin_memset(e, 0, sizeof(*e));
	e->t_ns = bpf_ktime_get_ns();
	e->kind = kind;
	e->slot = slot;
	e->prio = prio;
	e->value = value;
	bpf_ringbuf_submit(e, 0);
}

/* RED's average, updated per arrival as sch_red does: avg += (q - avg) * 2^-wlog,
 * and decayed over an idle period as if avg-sized packets had found it empty. */
static __always_inline __u64 red_average(struct port *p, struct prio_state *q, __u64 backlog,
					 __u64 now)
{
	__u64 avg = q->avg_scaled;

	if (backlog == 0 && q->idle_since_ns && p->packet_ns) {
		/* (1 - 2^-wlog)^m halves every ~0.693 * 2^wlog packet times */
		__u64 m = (now - q->idle_since_ns) / p->packet_ns;
		__u64 halvings = m * 1000 / ((__u64)693 << (p->wlog & 31));

		avg = halvings >= 64 ? 0 : avg >> halvings;
		q->idle_since_ns = 0;
	}
	avg = avg + ((backlog << AVG_SHIFT) >> (p->wlog & 31)) - (avg >> (p->wlog & 31));
	q->avg_scaled = avg;
	return avg >> AVG_SHIFT;
}

static __always_inline __u64 red_random(struct port *p)
{
	/* uniform in [0, (Kmax - Kmin) / Pmax): sch_red's qR */
	return (__u64)bpf_get_prandom_u32() * (p->kmax_bytes - p->kmin_bytes)
		/ (p->pmax_u32 ? p->pmax_u32 : 1);
}

/* sch_red's decision (red_action): between Kmin and Kmax a packet is marked once
 * (avg - Kmin) * (packets since the last mark) reaches a threshold drawn uniformly
 * at each mark, so marks come evenly spaced at RED's probability, not in clumps. */
static __always_inline int should_mark(struct port *p, struct prio_state *q, __u64 avg)
{
	if (avg < p->kmin_bytes) {
		q->red_count = -1;
		return 0;
	}
	if (avg >= p->kmax_bytes) {
		q->red_count = -1;
		return 1;
	}
	if (++q->red_count) {
		if ((avg - p->kmin_bytes) * (__u64)q->red_count < q->red_r)
			return 0;
		q->red_count = 0;
		q->red_r = red_random(p);
		return 1;
	}
	q->red_r = red_random(p);
	return 0;
}

static __always_inline void mark_ce(struct __sk_buff *skb, struct iphdr *ip)
{
	/* the header checksum covers TOS in the 16-bit word it shares with version/IHL */
	__u16 old_word = *(__u16 *)ip;
	__u8 tos = ip->tos | 3;
	__u16 new_word = bpf_htons((bpf_ntohs(old_word) & 0xff00) | tos);

	bpf_l3_csum_replace(skb, ETH_HLEN + __builtin_offsetof(struct iphdr, check),
			    old_word, new_word, 2);
	bpf_skb_store_bytes(skb, ETH_HLEN + __builtin_offsetof(struct iphdr, tos), &tos, 1, 0);
}

struct mac_control {
	__be16 opcode;
	__be16 enable;          /* PFC: class-enable vector; PAUSE: the pause time */
	__be16 time[PRIOS];
};

/* A PFC or PAUSE frame's fields (the caller checked the EtherType); a PAUSE frame
 * reads as a PFC frame pausing every priority. 0 if it is neither. */
static __always_inline int mac_control(struct __sk_buff *skb, struct mac_control *mc)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct mac_control *f = data + ETH_HLEN;

	if ((void *)(f + 1) > end)
		return 0;
	*mc = *f;
	if (mc->opcode == bpf_htons(OPCODE_PAUSE)) {
		__u16 t = mc->enable;
		int i;

		mc->enable = bpf_htons(0xff);
		for (i = 0; i < PRIOS; i++)
			mc->time[i] = t;
		return 1;
	}
	return mc->opcode == bpf_htons(OPCODE_PFC);
}

/* Counts a PFC frame per priority; one received (now: its arrival) also holds each
 * paused priority until its time runs out, as the MAC sees it (0 on a resume). One
 * loop for both: a second loop with branches multiplies the verifier's paths (it took
 * 0.1 s per program load, 2.4 s per fabric). */
static __always_inline void count_mac_control(struct port *p, struct mac_control *mc, int tx,
					      __u64 now)
{
	__u16 enable = bpf_ntohs(mc->enable);
	int i;

	for (i = 0; i < PRIOS; i++) {
		__u64 t = bpf_ntohs(mc->time[i]);

		if (!(enable >> i & 1))
			continue;
		if (!tx)
			p->q[i].paused_until_ns = t ? now + t * p->quantum_ns : 0;
		if (t)
			__sync_fetch_and_add(tx ? &p->q[i].pfc_tx_pause : &p->q[i].pfc_rx_pause, 1);
		else
			__sync_fetch_and_add(tx ? &p->q[i].pfc_tx_resume : &p->q[i].pfc_rx_resume, 1);
	}
}

SEC("tc/egress")
int port_egress(struct __sk_buff *skb)
{
	struct port *p = port_at(port_slot);
	struct prio_state *q;
	struct iphdr *ip;
	__u64 backlog, len = skb->len, now;
	int prio;

	if (!p)
		return TC_ACT_OK;
	if (skb->protocol == bpf_htons(MAC_CONTROL)) {
		struct mac_control mc;

		/* the switch's own PFC frames: counted, never queued (sent htb-direct) */
		if (mac_control(skb, &mc))
			count_mac_control(p, &mc, 1, 0);
		return TC_ACT_OK;
	}
	prio = classify(skb, p, &ip);
	q = &p->q[prio & (PRIOS - 1)];
	backlog = backlog_of(q);
	if (p->cfg[prio & (PRIOS - 1)].limit_bytes &&
	    backlog + len > p->cfg[prio & (PRIOS - 1)].limit_bytes) {
		__sync_fetch_and_add(&q->drop_packets, 1);
		__sync_fetch_and_add(&q->drop_bytes, len);
		return TC_ACT_SHOT;
	}
	now = bpf_ktime_get_ns();
	if (ip && (p->ecn_prio_mask >> prio & 1) && (ip->tos & 3) && (ip->tos & 3) != 3) {
		if (should_mark(p, q, red_average(p, q, backlog, now))) {
			mark_ce(skb, ip);
			__sync_fetch_and_add(&q->ce_marked, 1);
		}
	}
	__sync_fetch_and_add(&q->in_bytes, len);
	__sync_fetch_and_add(&q->in_packets, 1);
	backlog += len;
	if (p->cfg[prio & (PRIOS - 1)].xoff_bytes && backlog >= p->cfg[prio & (PRIOS - 1)].xoff_bytes
	    && __sync_val_compare_and_swap(&q->xoff, 0, 1) == 0) {
		__sync_fetch_and_add(&q->xoff_signals, 1);
		notify(EV_XOFF, port_slot, prio, backlog);
	}
	return TC_ACT_OK;
}

SEC("tc/ingress")
int port_ingress(struct __sk_buff *skb)
{
	struct port *peer = port_at(peer_slot), *own;
	struct prio_state *q;
	struct iphdr *ip;
	__u64 backlog;
	int prio;

	if (skb->protocol == bpf_htons(MAC_CONTROL)) {
		struct port *p = port_at(port_slot);
		struct mac_control mc;
		struct event *e;
		__u16 enable;
		__u64 now;
		int i;

		if (!p || !mac_control(skb, &mc))
			return TC_ACT_OK;
		now = bpf_ktime_get_ns();
		count_mac_control(p, &mc, 0, now);
		enable = bpf_ntohs(mc.enable);
		/* user space closes a gate only for the priorities no NIC here honours */
		for (i = 0; i < PRIOS; i++)
			if (p->cfg[i].nic_honours)
				enable &= ~(1 << i);
		if (!enable)
			return switch_port ? TC_ACT_SHOT : TC_ACT_OK;
		e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
		if (!e)
			return TC_ACT_OK;
		e->t_ns = now;
		e->kind = EV_PAUSE_RX;
		e->slot = port_slot;
		e->prio = 0;
		e->value = enable;
		for (i = 0; i < PRIOS; i++)
			e->quanta[i] = bpf_ntohs(mc.time[i]);
		bpf_ringbuf_submit(e, 0);
		/* a switch's MAC acts on a pause frame and forwards it nowhere (a capture on
		 * the port still shows it: taps see frames before this hook); a GPU host's
		 * transport reads it too, as its NIC's driver would report it */
		return switch_port ? TC_ACT_SHOT : TC_ACT_OK;
	}
	own = port_at(port_slot);
	if (own) {     /* what enters the switch: frames lost inside it show against this */
		q = &own->q[classify(skb, own, &ip) & (PRIOS - 1)];
		__sync_fetch_and_add(&q->rx_packets, 1);
		__sync_fetch_and_add(&q->rx_bytes, skb->len);
	}
	if (!peer)
		return TC_ACT_OK;
	prio = classify(skb, peer, &ip);
	q = &peer->q[prio & (PRIOS - 1)];
	__sync_fetch_and_add(&q->out_bytes, skb->len);
	__sync_fetch_and_add(&q->out_packets, 1);
	backlog = backlog_of(q);
	if (backlog == 0)
		q->idle_since_ns = bpf_ktime_get_ns();
	if (q->xoff && backlog <= peer->cfg[prio & (PRIOS - 1)].xon_bytes
	    && __sync_val_compare_and_swap(&q->xoff, 1, 0) == 1) {
		__sync_fetch_and_add(&q->xon_signals, 1);
		notify(EV_XON, peer_slot, prio, backlog);
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
