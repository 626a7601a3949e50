// SPDX-License-Identifier: GPL-2.0
/* fabriclab's per-packet switch port: ECN marking, packet trimming and the PFC trigger,
 * in the kernel.
 *
 * Two tc programs per link end (lab/kernel/dataplane.py loads and attaches them):
 *   egress   on a switch port: every frame that enters the port's queues (the
 *            egress hook runs before the qdisc enqueues). It classifies the frame
 *            by DSCP as the port's u32 filters do, trims a RoCE frame to its
 *            headers where trimming is on and its queue is past the trim point
 *            (trim), drops it when its priority's
 *            buffer is full (so every drop is counted here, and a frame counted
 *            as marked is a frame that is sent), marks CE with RED's probability
 *            of the average backlog, and charges a lossless frame to the port it
 *            entered the switch through: XOFF for that ingress port the moment
 *            its bytes waiting in the switch pass its threshold.
 *   ingress  on every link end: the frames the peer's queues sent (departures:
 *            the peer's backlog falls, and so do the bytes charged to the port
 *            the frame entered the peer through: XON when they pass below the
 *            resume threshold), the frames entering this switch (remembered
 *            with this port as their ingress), and the PFC / PAUSE frames the
 *            peer's MAC sent (this port must stop: signalled at once to user
 *            space, which closes the port's gate).
 *
 * PFC as shared-buffer switches account it: per (ingress port, priority), with a
 * dynamic threshold (Choudhury and Hahne): an ingress pauses when its bytes pass
 * alpha x the free part of the queue they wait in, where the free part leaves out
 * the queue's headroom (what every port feeding the queue may still send between
 * its pause being decided and taking hold; user space sizes it), and at most at
 * the priority's static XOFF. The frame's ingress crosses OVS's user space, which
 * keeps no metadata: the ingress program records it in the `origins` hash, keyed
 * by what OVS does not rewrite (addresses, IP id and length, the first bytes of
 * L4: ports, and for RoCE its BTH with QP and PSN); the egress program looks the
 * frame up when it is queued, the peer's ingress when it leaves.
 * A queue's backlog is what entered it minus what left it (both counted per
 * packet), not a sample. What leaves unseen (a queue flushed when its link goes
 * down) user space finds against the kernel's own backlog and writes off
 * (out_adjust). Events go to user space through a ring buffer; the
 * counters sit in one array, mapped into user space. Each program is loaded once
 * and attached to every port; an attachment's tc filter carries the port's slot as
 * its classid, which cls_bpf hands the program in skb->tc_classid (the peer's slot
 * and whether the port is a switch's come from the slot's entry). Loaded per port
 * instead (the slot as read-only data), the verifier ran 5,120 times for a
 * 1024-host fabric: 51 s of its build.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/udp.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "dataplane.h"

/* The maps: the loader creates them (no BTF needed) and binds these symbols. */
char ports[4] SEC("maps");
char events[4] SEC("maps");
char origins[4] SEC("maps");    /* LRU hash: origin_key -> origin */
char sends[4] SEC("maps");      /* ring of send_request, read by lab/kernel/pfc_sender.c */
char history[4] SEC("maps");    /* array of struct history: telemetry's looks per queue */

/* The link end this program runs on (its filter's classid: see above) */
static __always_inline __u32 own_slot(struct __sk_buff *skb)
{
	return skb->tc_classid;
}

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

/* Adds `len` to what entered the queue and returns the backlog before it, in one
 * atomic step: a frame queued at the same time on the other CPU sees this one's bytes. */
static __always_inline __u64 reserve(struct prio_state *q, __u64 len)
{
	__u64 in = __sync_fetch_and_add(&q->in_bytes, len), out = q->out_bytes + q->out_adjust;

	return in > out ? in - out : 0;
}

/* A decision for user space: a frame it must send now (sent 0) wakes it; one the
 * program sent waits for its next look (its log and its counts are not urgent). The
 * wake-up is forced: by default the ring wakes its reader only for a record at the
 * head, and records left waiting may be ahead of this one. */
static __always_inline void notify(__u32 kind, __u32 slot, __u32 prio, __u32 value,
				   __u32 queue, __u32 threshold, __u32 sent)
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
	e->queue = queue;
	e->threshold = threshold;
	e->sent = sent;
	bpf_ringbuf_submit(e, sent ? BPF_RB_NO_WAKEUP : BPF_RB_FORCE_WAKEUP);
}

/* Queue (p, prio) as it stands now, into its history: the look of the current period
 * (telemetry reads finished periods: lab/fabric/telemetry.py). Two CPUs may write one look at
 * once; each writes a state the queue was in during the period. */
static __always_inline void note(struct port *p, __u32 prio, __u64 now)
{
	struct prio_state *q = &p->q[prio & (PRIOS - 1)];
	struct history *h;
	struct look *l;
	__u32 key;
	__u64 period;

	if (p->history == NO_SLOT || !p->look_ns)
		return;
	key = p->history * PRIOS + (prio & (PRIOS - 1));
	h = bpf_map_lookup_elem(&history, &key);
	if (!h)
		return;
	period = now / p->look_ns;
	l = &h->looks[period & (HISTORY_LOOKS - 1)];
	l->period = period;
	l->backlog_bytes = backlog_of(q);
	l->backlog_packets = q->in_packets > q->out_packets ? q->in_packets - q->out_packets : 0;
	l->sent_packets = q->out_packets;
	l->drop_packets = q->drop_packets;
	l->ce_marked = q->ce_marked;
	l->paused_until_ns = q->paused_until_ns;
}

static __always_inline __u64 held_of(struct prio_state *q)
{
	__u64 in = q->held_in_bytes, out = q->held_out_bytes + q->held_adjust;

	return in > out ? in - out : 0;
}

/* What an ingress may hold in queue c (whose backlog is given) before it must pause:
 * alpha x the queue's free shared part, at most the static XOFF. */
static __always_inline __u64 xoff_threshold(struct prio_cfg *c, __u64 backlog)
{
	__u64 shared = c->limit_bytes > c->headroom_bytes ? c->limit_bytes - c->headroom_bytes : 0;
	__u64 dynamic = shared > backlog ? (shared - backlog) * c->alpha_q8 >> 8 : 0;

	return dynamic < c->xoff_bytes ? dynamic : c->xoff_bytes;
}

/* ...and below which it may resume: the same ratio of XON to XOFF. Zero held always
 * resumes (nothing of the port's waits: nothing else would wake it). */
static __always_inline __u64 xon_threshold(struct prio_cfg *c, __u64 backlog)
{
	return xoff_threshold(c, backlog) * c->xon_bytes / (c->xoff_bytes ? c->xoff_bytes : 1);
}

/* The frame's key in `origins` (IPv4: the caller checked). Read with loads, not
 * through packet pointers: marking CE rewrote the packet, which voids them. */
static __always_inline int origin_key(struct __sk_buff *skb, struct origin_key *k)
{
	struct iphdr ip;

	__builtin_memset(k, 0, sizeof(*k));
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
		return 0;
	k->saddr = ip.saddr;
	k->daddr = ip.daddr;
	k->id = ip.id;
	k->tot_len = ip.tot_len;
	k->protocol = ip.protocol;
	/* a short L4 part (an 8-byte UDP header and little data) keys on what there is */
	if (bpf_skb_load_bytes(skb, ETH_HLEN + ip.ihl * 4, k->l4, ORIGIN_L4_BYTES) < 0)
		bpf_skb_load_bytes(skb, ETH_HLEN + ip.ihl * 4, k->l4, 8);
	return 1;
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
		if (!tx) {
			p->q[i].paused_until_ns = t ? now + t * p->quantum_ns : 0;
			note(p, i, now);
		} else {
			p->q[i].wire_xoff = t != 0;
		}
		if (t)
			__sync_fetch_and_add(tx ? &p->q[i].pfc_tx_pause : &p->q[i].pfc_rx_pause, 1);
		else
			__sync_fetch_and_add(tx ? &p->q[i].pfc_tx_resume : &p->q[i].pfc_rx_resume, 1);
	}
}

/* The PFC frame for `prio` out of switch port `in`, as its MAC sends one: at once,
 * without user space. A copy of the frame in hand goes to the port's egress, whose
 * program turns it into the PFC frame (pfc_frame). 0 if sent; else user space must
 * send it (a port without a device here: its PFC frames leave from user space). */
static __always_inline int send_pfc(struct __sk_buff *skb, struct port *in, __u32 prio,
				    int xoff)
{
	__u32 mark = skb->mark;
	int err;

	if (!in->ifindex || (xoff && !in->pause_quanta))
		return -1;
	skb->mark = PFC_MARK | (xoff ? PFC_MARK_XOFF : 0) | (prio & (PRIOS - 1));
	err = bpf_clone_redirect(skb, in->ifindex, 0);
	skb->mark = mark;
	return err;
}

/* A decision for ingress port `slot` (in): its PFC frame sent at once if this program
 * can reach the port's device (`here`), and lab/kernel/pfc_sender.c told of every XON and of
 * an XOFF not sent: it sends what was not sent, from the switch's namespace, and looks
 * again a moment later (an XOFF and an XON decided on two CPUs at once may send their
 * frames in the other order: the port's last frame must say what its flag says; an
 * XON follows every XOFF, so its second look covers both). 1 if the frame was sent or
 * handed over (0: the ring is full, no sender reads it: user space, woken, sends it). */
static __always_inline int carry_out(struct __sk_buff *skb, struct port *in, __u32 slot,
				     __u32 prio, int xoff, int here)
{
	int sent = here && send_pfc(skb, in, prio, xoff) == 0;
	struct send_request *r;

	if (xoff && sent)
		return 1;
	r = bpf_ringbuf_reserve(&sends, sizeof(*r), 0);
	if (!r)
		return sent;
	r->slot = slot;
	r->prio = prio;
	bpf_ringbuf_submit(r, BPF_RB_FORCE_WAKEUP);
	return 1;
}

/* A copy marked by send_pfc, on its way out of port p: becomes p's PFC frame, sent
 * past the port's queues (as the controller's own frames are: htb-direct). */
static __always_inline int pfc_frame(struct __sk_buff *skb, struct port *p)
{
	__u32 prio = skb->mark & (PRIOS - 1);
	int xoff = !!(skb->mark & PFC_MARK_XOFF);
	struct pfc f;

	__builtin_memset(&f, 0, sizeof(f));
	f.dst[0] = 0x01;
	f.dst[1] = 0x80;
	f.dst[2] = 0xc2;
	f.dst[5] = 0x01;
	__builtin_memcpy(f.src, p->mac, ETH_ALEN);
	f.type = bpf_htons(MAC_CONTROL);
	f.mc.opcode = bpf_htons(OPCODE_PFC);
	f.mc.enable = bpf_htons(1 << prio);
	f.mc.time[prio] = bpf_htons(xoff ? p->pause_quanta : 0);
	skb->mark = 0;
	if (bpf_skb_change_tail(skb, sizeof(f), 0) || bpf_skb_store_bytes(skb, 0, &f, sizeof(f), 0))
		return TC_ACT_SHOT;
	skb->priority = HTB_DIRECT;
	count_mac_control(p, &f.mc, 1, 0);
	return TC_ACT_OK;
}

/* A lossless frame just queued on this port (p, its priority's state q): charged to
 * the port it entered the switch through, which pauses if it now holds too much. */
static __always_inline void charge_ingress(struct __sk_buff *skb, struct port *p,
					   struct prio_state *q, int prio, __u64 backlog,
					   __u64 len)
{
	struct origin_key k;
	struct origin *o;
	struct port *in;
	struct prio_state *h;
	__u64 held, threshold;

	if (!origin_key(skb, &k))
		return;
	o = bpf_map_lookup_elem(&origins, &k);
	/* unknown (sent by the switch itself, or forgotten by the LRU), or an identical
	 * frame already charged (a copy in flight): the ingress holds it uncounted */
	if (!o || o->queue != NO_SLOT || !(in = port_at(o->ingress))) {
		__sync_fetch_and_add(&q->unattributed, 1);
		return;
	}
	o->queue = own_slot(skb);
	o->len = len;
	o->prio = prio;
	h = &in->q[prio];
	__sync_fetch_and_add(&h->held_in_bytes, len);
	held = held_of(h);
	threshold = xoff_threshold(&p->cfg[prio], backlog);
	if (held >= threshold && __sync_val_compare_and_swap(&h->xoff, 0, 1) == 0) {
		__sync_fetch_and_add(&h->xoff_signals, 1);
		notify(EV_XOFF, o->ingress, prio, held, own_slot(skb), threshold,
		       carry_out(skb, in, o->ingress, prio, 1, 1));
	}
}

/* An IPv4 frame arrived on this link end. It left the peer's queue:
 * if it was charged there, its ingress on the peer's switch holds less (and may
 * resume). On a switch it has entered through this port: remembered. */
static __always_inline void follow_origin(struct __sk_buff *skb, struct port *peer,
					  struct port *own)
{
	struct origin_key k;
	struct origin *o;

	if (!origin_key(skb, &k))
		return;
	o = bpf_map_lookup_elem(&origins, &k);
	if (o && peer && o->queue == own->peer_slot) {
		struct port *in = port_at(o->ingress);
		int prio = o->prio & (PRIOS - 1);

		if (in) {
			struct prio_state *h = &in->q[prio];
			__u64 held, backlog = backlog_of(&peer->q[prio]), threshold;

			__sync_fetch_and_add(&h->held_out_bytes, o->len);
			held = held_of(h);
			threshold = xon_threshold(&peer->cfg[prio], backlog);
			if (h->xoff && held <= threshold
			    && __sync_val_compare_and_swap(&h->xoff, 1, 0) == 1) {
				__sync_fetch_and_add(&h->xon_signals, 1);
				/* sent here only from the switch's side: a host's end
				 * lives in another namespace than the switch's ports */
				notify(EV_XON, o->ingress, prio, held, own->peer_slot, threshold,
				       carry_out(skb, in, o->ingress, prio, 0,
						 own->role != ROLE_HOST));
			}
		}
		o->queue = NO_SLOT;
	}
	if (own->role != ROLE_SWITCH) {  /* delivered to a host, or gone to another
					  * machine: its journey here ends */
		if (o)
			bpf_map_delete_elem(&origins, &k);
		return;
	}
	if (o) {
		o->ingress = own_slot(skb);
		o->queue = NO_SLOT;
	} else {
		struct origin fresh = {.ingress = own_slot(skb), .queue = NO_SLOT};

		bpf_map_update_elem(&origins, &k, &fresh, BPF_ANY);
	}
}

/* A RoCE v2 frame (UDP to 4791) longer than its trimmed self: one packet trimming may cut. */
static __always_inline int trimmable(struct __sk_buff *skb, struct iphdr *ip)
{
	void *end = (void *)(long)skb->data_end;
	struct udphdr *udp = (void *)(ip + 1);

	if (ip->ihl != 5 || ip->protocol != IPPROTO_UDP || (void *)(udp + 1) > end)
		return 0;
	return udp->dest == bpf_htons(ROCE_V2_PORT) && skb->len > TRIMMED_FRAME_BYTES;
}

/* Packet trimming (UET's, MRC's TRIM NACK): instead of dropping a frame its queue has
 * no room for, the port cuts it to its headers and sends those on in the queue of
 * `dscp`, so the receiver learns at once which packet was lost and asks for it again
 * (traffic/mrc.py). The IPv4 length and checksum follow the cut; RoCE sends no UDP
 * checksum, so the UDP length is all its header needs; the ICRC goes with the payload
 * (the DSCP tells the receiver not to look for it). */
static __always_inline int trim(struct __sk_buff *skb, struct iphdr *ip, __u32 dscp)
{
	__u16 old_word = *(__u16 *)ip, old_len = ip->tot_len;
	__u8 tos = (__u8)(dscp << 2) | (ip->tos & 3);
	__u16 new_word = bpf_htons((bpf_ntohs(old_word) & 0xff00) | tos);
	__u16 new_len = bpf_htons(TRIMMED_FRAME_BYTES - ETH_HLEN);
	__u16 udp_len = bpf_htons(TRIMMED_FRAME_BYTES - ETH_HLEN - sizeof(struct iphdr));
	__u32 csum = ETH_HLEN + __builtin_offsetof(struct iphdr, check);

	/* (the helpers void the packet pointers: every value read above) */
	if (bpf_l3_csum_replace(skb, csum, old_word, new_word, 2) ||
	    bpf_l3_csum_replace(skb, csum, old_len, new_len, 2) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN + __builtin_offsetof(struct iphdr, tos), &tos, 1, 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN + __builtin_offsetof(struct iphdr, tot_len),
				&new_len, 2, 0) ||
	    bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(struct iphdr)
				+ __builtin_offsetof(struct udphdr, len), &udp_len, 2, 0))
		return -1;
	return bpf_skb_change_tail(skb, TRIMMED_FRAME_BYTES, 0);
}

/* What becomes of a frame the queue has no room for. A switch port drops it without a
 * word to the sender (TC_ACT_STOLEN: the kernel tells the sender it went out), as a
 * switch's drop is: with TC_ACT_SHOT the send fails with ENOBUFS, and OVS's userspace
 * datapath offers the same frame again in the rest of its sendmmsg batch, which this
 * program then counted a second time, as a drop or as queued (measured: pfc-spreading's
 * ECN variant, up to 4 drops a run more at a queue than the wire showed, and as many
 * frames "lost inside" the switch below zero). A GPU host's port refuses it (ENOBUFS):
 * its NIC keeps the frame and sends it again later (traffic/nic.py). */
static __always_inline int no_room(const struct port *p)
{
	return p->role == ROLE_HOST ? TC_ACT_SHOT : TC_ACT_STOLEN;
}

SEC("tc/egress")
int port_egress(struct __sk_buff *skb)
{
	struct port *p = port_at(own_slot(skb));
	struct prio_state *q;
	struct iphdr *ip;
	__u64 backlog, len = skb->len, now;
	int prio;

	if (!p)
		return TC_ACT_OK;
	if ((skb->mark & PFC_MARK_MASK) == PFC_MARK)
		return pfc_frame(skb, p);
	if (skb->protocol == bpf_htons(MAC_CONTROL)) {
		struct mac_control mc;

		/* the switch's own PFC frames: counted, never queued (sent htb-direct) */
		if (mac_control(skb, &mc))
			count_mac_control(p, &mc, 1, 0);
		return TC_ACT_OK;
	}
	prio = classify(skb, p, &ip);
	q = &p->q[prio & (PRIOS - 1)];
	/* The frame's room is taken before it is checked, and given back if it has none:
	 * the two CPUs may queue to one port at once, and two frames checked against the
	 * same backlog and admitted both overfill the kernel's queue, which drops one the
	 * program counted as admitted (measured: one such drop in ~2 s of two senders
	 * pinned to the two CPUs; in the lab VM, a trimming run's one untrimmed drop). */
	backlog = reserve(q, len);
	now = bpf_ktime_get_ns();
	if (ip && p->cfg[prio & (PRIOS - 1)].trim_bytes &&
	    backlog + len > p->cfg[prio & (PRIOS - 1)].trim_bytes && trimmable(skb, ip)) {
		__sync_fetch_and_sub(&q->in_bytes, len);
		__sync_fetch_and_add(&q->trimmed, 1);
		note(p, prio, now);
		if (trim(skb, ip, p->cfg[prio & (PRIOS - 1)].trim_dscp & 63))
			return no_room(p);
		/* Sent again through this port: the kernel took the frame's length for
		 * its queues before this hook, and would charge the headers as the whole
		 * frame (in the class's byte limit and on the link). On the second pass
		 * they are a frame like any other, queued where their DSCP puts them. */
		return bpf_redirect(skb->ifindex, 0);
	}
	if (p->cfg[prio & (PRIOS - 1)].limit_bytes &&
	    backlog + len > p->cfg[prio & (PRIOS - 1)].limit_bytes) {
		__sync_fetch_and_sub(&q->in_bytes, len);
		__sync_fetch_and_add(&q->drop_packets, 1);
		__sync_fetch_and_add(&q->drop_bytes, len);
		note(p, prio, now);
		return no_room(p);
	}
	if (ip && (p->ecn_prio_mask >> prio & 1) && (ip->tos & 3) && (ip->tos & 3) != 3) {
		if (should_mark(p, q, red_average(p, q, backlog, now))) {
			mark_ce(skb, ip);
			__sync_fetch_and_add(&q->ce_marked, 1);
		}
	}
	__sync_fetch_and_add(&q->in_packets, 1);
	note(p, prio, now);
	if (ip && p->cfg[prio & (PRIOS - 1)].xoff_bytes)
		charge_ingress(skb, p, q, prio & (PRIOS - 1), backlog + len, len);
	return TC_ACT_OK;
}

SEC("tc/ingress")
int port_ingress(struct __sk_buff *skb)
{
	struct port *own = port_at(own_slot(skb)), *peer;
	struct prio_state *q;
	struct iphdr *ip;
	int prio;

	if (!own)
		return TC_ACT_OK;
	/* a stub passes pause frames untouched: the local switch port's own, counted as
	 * they left (its egress), on their way to the other machine's port, which
	 * honours them */
	if (own->role == ROLE_STUB && skb->protocol == bpf_htons(MAC_CONTROL))
		return TC_ACT_OK;
	if (skb->protocol == bpf_htons(MAC_CONTROL)) {
		struct port *p = own;
		struct mac_control mc;

		struct event *e;
		__u16 enable;
		__u64 now;
		int i;

		if (!mac_control(skb, &mc))
			return TC_ACT_OK;
		now = bpf_ktime_get_ns();
		count_mac_control(p, &mc, 0, now);
		enable = bpf_ntohs(mc.enable);
		/* user space closes a gate only for the priorities no NIC here honours */
		for (i = 0; i < PRIOS; i++)
			if (p->cfg[i].nic_honours)
				enable &= ~(1 << i);
		if (!enable)
			return p->role == ROLE_SWITCH ? TC_ACT_SHOT : TC_ACT_OK;
		e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
		if (!e)
			return TC_ACT_OK;
		e->t_ns = now;
		e->kind = EV_PAUSE_RX;
		e->slot = own_slot(skb);
		e->prio = 0;
		e->value = enable;
		for (i = 0; i < PRIOS; i++)
			e->quanta[i] = bpf_ntohs(mc.time[i]);
		e->queue = 0;
		e->threshold = 0;
		e->sent = 0;
		e->pad = 0;
		bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);  /* a gate to close: urgent */
		/* a switch's MAC acts on a pause frame and forwards it nowhere (a capture on
		 * the port still shows it: taps see frames before this hook); a GPU host's
		 * transport reads it too, as its NIC's driver would report it */
		return p->role == ROLE_SWITCH ? TC_ACT_SHOT : TC_ACT_OK;
	}
	peer = port_at(own->peer_slot);
	/* what enters the switch: frames lost inside it show against this */
	prio = classify(skb, own, &ip) & (PRIOS - 1);
	q = &own->q[prio];
	__sync_fetch_and_add(&q->rx_packets, 1);
	__sync_fetch_and_add(&q->rx_bytes, skb->len);
	if (peer) {
		int left = classify(skb, peer, &ip) & (PRIOS - 1);
		__u64 now = bpf_ktime_get_ns();

		q = &peer->q[left];
		__sync_fetch_and_add(&q->out_bytes, skb->len);
		__sync_fetch_and_add(&q->out_packets, 1);
		if (backlog_of(q) == 0)
			q->idle_since_ns = now;
		note(peer, left, now);
	}
	/* lossless frames are followed through the switches (the peer's priority map is
	 * the fabric's: one DSCP map everywhere) */
	if (ip && (own->cfg[prio].xoff_bytes || (peer && peer->cfg[prio].xoff_bytes)))
		follow_origin(skb, peer, own);
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
