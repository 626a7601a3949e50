/* SPDX-License-Identifier: GPL-2.0 */
/* The layouts the data path's programs (dataplane.bpf.c), its PFC sender
 * (pfc_sender.c) and lab/kernel/dataplane.py share: change them together (the static
 * asserts below check the sizes lab/kernel/dataplane.py declares). */
#ifndef FL_DATAPLANE_H
#define FL_DATAPLANE_H

#include <linux/types.h>
#include <linux/if_ether.h>

#define PRIOS 8
#define NO_SLOT 0xffffffff
#define MAC_CONTROL 0x8808
#define OPCODE_PAUSE 0x0001
#define OPCODE_PFC 0x0101
#define AVG_SHIFT 10            /* RED's average backlog in bytes << AVG_SHIFT */
#define EV_XOFF 1
#define EV_XON 2
#define EV_PAUSE_RX 3
/* A link end's role. A stub stands in for a switch port on another machine: the far
 * end of a link that crosses machines, on this machine (lab/kernel/tunnel.py). What
 * enters it has left the local switch port's queue; PFC frames pass it untouched, to
 * be honoured where they arrive, by the other machine's switch port. */
#define ROLE_HOST 0             /* a GPU host's NIC */
#define ROLE_SWITCH 1           /* a switch's port, whose MAC consumes pauses */
#define ROLE_STUB 2
/* skb->mark of a copy that a port's egress program turns into its PFC frame: the
 * top half says so, bit 8 XOFF (else XON), the low bits the priority */
#define PFC_MARK 0xf1c00000
#define PFC_MARK_MASK 0xffff0000
#define PFC_MARK_XOFF 0x100
#define HTB_DIRECT 0x10000      /* skb->priority 1:0: past queues.py's classes, unshaped */
#define ORIGIN_L4_BYTES 20      /* UDP + RoCE's BTH (opcode, QP, PSN); TCP's header */
#define ROCE_V2_PORT 4791
/* A trimmed frame: the headers of an MRC data packet (Ethernet, IPv4, UDP, BTH, RETH,
 * ImmDt), its payload and ICRC cut off (traffic/constants.py's TRIMMED_FRAME_BYTES) */
#define TRIMMED_FRAME_BYTES 74

/* lab/kernel/dataplane.py declares the same layouts (PORT, EVENT): change both together */
struct prio_cfg {
	__u32 limit_bytes;      /* the priority's buffer; a frame that does not fit is dropped */
	__u32 xoff_bytes;       /* 0: not lossless; else the most an ingress may hold */
	__u32 xon_bytes;
	__u32 nic_honours;      /* 1: the NIC at this link end (a GPU agent's transport)
				 * stops this priority itself when a pause arrives: no gate */
	__u32 headroom_bytes;   /* of limit_bytes, kept for what arrives after pauses */
	__u32 alpha_q8;         /* the dynamic threshold's alpha x 256 */
	__u32 trim_bytes;       /* 0: a frame that does not fit is dropped; else a RoCE frame
				 * that would take the backlog past this is trimmed */
	__u32 trim_dscp;        /* ...to its headers, with this DSCP (which picks its queue) */
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
	__u64 held_in_bytes;    /* as an ingress: bytes that entered the switch here, queued */
	__u64 held_out_bytes;   /* ...and left their queue */
	__u64 held_adjust;      /* bytes user space found charged to this port and gone */
	__u64 unattributed;     /* lossless frames queued here whose ingress is unknown */
	__u64 trimmed;          /* frames of this priority trimmed here (queued in trim_dscp's) */
	__u32 xoff;             /* 1 while XOFF is decided for this port as an ingress */
	__s32 red_count;        /* RED: packets since the last mark (-1: outside Kmin..Kmax) */
	__u32 wire_xoff;        /* 1 if the last PFC frame this port sent paused this priority */
	__u32 pad;
};

struct port {
	__u32 ecn_prio_mask;    /* priorities whose ECT frames may be marked CE */
	__u32 kmin_bytes;
	__u32 kmax_bytes;
	__u32 pmax_u32;         /* Pmax * 2^32 */
	__u32 wlog;             /* RED's EWMA weight: 2^-wlog */
	__u32 packet_ns;        /* an average packet's time on the link (idle decay) */
	__u32 quantum_ns;       /* a pause quantum (512 bit times) on this port's link */
	__u32 ifindex;          /* a switch port's device, where its own PFC frames leave
				 * (0: user space sends them) */
	__u8 dscp_prio[64];
	__u8 mac[6];            /* the source of the port's PFC frames */
	__u16 pause_quanta;     /* an XOFF's pause time */
	__u32 history;          /* a switch port's first entry in `history` (NO_SLOT: none) */
	__u32 look_ns;          /* telemetry's period (0: no history kept) */
	__u32 peer_slot;        /* the switch port at the link's other end (NO_SLOT: a
				 * host's or a stub's) */
	__u32 role;             /* ROLE_*: which kind of link end this is */
	struct prio_cfg cfg[PRIOS];
	struct prio_state q[PRIOS];
};

struct event {
	__u64 t_ns;
	__u32 kind;
	__u32 slot;
	__u32 prio;
	__u32 value;            /* the ingress's bytes held (XOFF/XON), or the class-enable
				 * vector (PAUSE_RX) */
	__u16 quanta[PRIOS];    /* PAUSE_RX: pause time per priority */
	__u32 queue;            /* XOFF/XON: the queue (slot) the deciding frame entered or left */
	__u32 threshold;        /* XOFF/XON: the threshold it was held against */
	__u32 sent;             /* XOFF/XON: 1 if the program sent the PFC frame itself */
	__u32 pad;
};

/* A frame on its way through the fabric, by what OVS leaves as it is */
struct origin_key {
	__u32 saddr;
	__u32 daddr;
	__u16 id;
	__u16 tot_len;
	__u32 protocol;
	__u8 l4[ORIGIN_L4_BYTES];
};

struct origin {
	__u32 ingress;          /* the port it entered its current switch through */
	__u32 queue;            /* the queue it is charged to (NO_SLOT: none yet) */
	__u32 len;
	__u32 prio;
};

_Static_assert(sizeof(struct port) == 2104, "lab/kernel/dataplane.py's PORT_BYTES");
_Static_assert(sizeof(struct event) == 56, "lab/kernel/dataplane.py's EVENT");
_Static_assert(sizeof(struct origin_key) == 36, "lab/kernel/dataplane.py's ORIGIN_KEY_BYTES");
_Static_assert(sizeof(struct origin) == 16, "lab/kernel/dataplane.py's ORIGIN_BYTES");

struct mac_control {
	__be16 opcode;
	__be16 enable;          /* PFC: class-enable vector; PAUSE: the pause time */
	__be16 time[PRIOS];
};

struct pfc {                    /* 802.1Qbb, 60 bytes: the shortest frame (no FCS) */
	__u8 dst[ETH_ALEN];
	__u8 src[ETH_ALEN];
	__be16 type;
	struct mac_control mc;
	__u8 pad[26];
};

/* A queue as it stood at the end of one of telemetry's periods (look_ns): what the
 * last frame to enter or leave it in that period left. No frame: as the period before. */
#define HISTORY_LOOKS 64        /* a ring of the last 64 periods, per queue */
struct look {
	__u64 period;           /* which one (CLOCK_MONOTONIC ns / look_ns) */
	__u64 backlog_bytes;
	__u64 backlog_packets;
	__u64 sent_packets;
	__u64 drop_packets;
	__u64 ce_marked;
	__u64 paused_until_ns;
};

struct history {
	struct look looks[HISTORY_LOOKS];
};

_Static_assert(sizeof(struct history) == 3584, "lab/kernel/dataplane.py's HISTORY_BYTES");

/* A PFC frame a program decided but could not send (another namespace than the
 * switch's ports): lab/kernel/pfc_sender.c sends it, as the port's flag says then */
struct send_request {
	__u32 slot;
	__u32 prio;
};

_Static_assert(sizeof(struct send_request) == 8, "lab/kernel/dataplane.py's SEND_REQUEST_BYTES");

#endif
