/* What a compiled data path could reach (bench/compiled_ceiling.py): RDMA WRITE MIDDLE
 * frames built from a header template and sent with one sendmmsg() per burst.
 * No transport logic: no ACKs, pacing or congestion control. The frames are the bytes
 * traffic/roce.py's Framer builds (the bench checks that before it measures).
 *
 *   int rc_burst(fd, template, payload, mtu, n, psn0, ip_id0, ip_fixed_sum)
 *
 * template: Ethernet + IPv4 + UDP + BTH of the first frame (54 bytes); payload: n * mtu
 * bytes; ip_fixed_sum: the IPv4 checksum's sum over the words that do not change
 * (Framer.fixed_sum). Returns what sendmmsg returns.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <zlib.h>

#define MAX_BURST 64
#define HEADERS 54                   /* Ethernet 14, IPv4 20, UDP 8, BTH 12 */
#define IP 14
#define UDP (IP + 20)
#define BTH (UDP + 8)

static uint8_t headers[MAX_BURST][HEADERS], icrcs[MAX_BURST][4];
static struct iovec iovs[MAX_BURST][3];
static struct mmsghdr msgs[MAX_BURST];

static void put16(uint8_t *p, uint32_t v) { p[0] = v >> 8; p[1] = v; }

int rc_burst(int fd, const uint8_t *template, const uint8_t *payload, int mtu, int n,
             uint32_t psn0, uint16_t ip_id0, uint32_t ip_fixed_sum)
{
    /* the ICRC: CRC-32 over 8 bytes of ones, then IP/UDP/BTH with the fields routers
     * rewrite set to ones (TOS, TTL, IP checksum, UDP checksum, BTH's FECN/BECN byte) */
    static const uint8_t ones[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    uint32_t seed = crc32(0, ones, 8);
    uint8_t masked[HEADERS - IP];
    if (n > MAX_BURST)
        n = MAX_BURST;
    for (int i = 0; i < n; i++) {
        uint8_t *h = headers[i];
        uint32_t ip_len = 20 + 8 + 12 + mtu + 4, id = (uint16_t)(ip_id0 + i);
        uint32_t sum = ip_fixed_sum + ip_len + id, psn = (psn0 + i) & 0xffffff;
        memcpy(h, template, HEADERS);
        put16(h + IP + 2, ip_len);
        put16(h + IP + 4, id);
        sum = (sum & 0xffff) + (sum >> 16);
        put16(h + IP + 10, ~(sum + (sum >> 16)) & 0xffff);
        put16(h + UDP + 4, ip_len - 20);
        h[BTH + 9] = psn >> 16;
        put16(h + BTH + 10, psn);
        memcpy(masked, h + IP, sizeof masked);
        masked[1] = masked[8] = masked[10] = masked[11] = 0xff;
        masked[26] = masked[27] = masked[32] = 0xff;
        const uint8_t *data = payload + (size_t)i * mtu;
        uint32_t c = crc32(crc32(seed, masked, sizeof masked), data, mtu);
        for (int b = 0; b < 4; b++)
            icrcs[i][b] = c >> (8 * b);          /* least significant byte first */
        iovs[i][0] = (struct iovec){h, HEADERS};
        iovs[i][1] = (struct iovec){(void *)data, (size_t)mtu};
        iovs[i][2] = (struct iovec){icrcs[i], 4};
        memset(&msgs[i], 0, sizeof msgs[i]);
        msgs[i].msg_hdr.msg_iov = iovs[i];
        msgs[i].msg_hdr.msg_iovlen = 3;
    }
    return sendmmsg(fd, msgs, n, MSG_DONTWAIT);
}
