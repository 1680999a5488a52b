/* The per-message loop of tools/bridge_floor.py in C (``--loop c``): the floor of a hop
 * from the bus to MQTT with no Python run per message, to tell how much of a Python
 * hop's added latency is the language and how much is the extra process.
 *
 * floor_loop(bus, mqtt, qos): blocks on *bus* (a connected SOCK_SEQPACKET socket already
 * subscribed), sends each "MSG key\0payload" packet as one MQTT PUBLISH on the topic of
 * its key (QoS 0 or 1, packet identifiers 1..65535 in turn) on *mqtt*, then reads what
 * the broker sent back without waiting and throws it away.  Returns 0 at the bus's end
 * of file, 1 when a signal interrupted a wait (the caller runs its handlers and calls
 * again), or -errno.
 */
#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

static unsigned char in[65536];
static unsigned char out[sizeof in + 16];

/* MQTT's Remaining Length: 7 bits a byte, least significant first. */
static size_t put_length(unsigned char *at, size_t n)
{
    size_t i = 0;
    do {
        unsigned char b = n % 128;
        n /= 128;
        at[i++] = n ? b | 128 : b;
    } while (n);
    return i;
}

int floor_loop(int bus, int mqtt, int qos)
{
    static unsigned mid;
    for (;;) {
        ssize_t n = recv(bus, in, sizeof in, 0);
        if (n == 0)
            return 0;
        if (n < 0)
            return errno == EINTR ? 1 : -errno;
        if (n < 5 || memcmp(in, "MSG ", 4) != 0)
            continue; /* control messages: not this tool's business */
        unsigned char *nul = memchr(in + 4, 0, (size_t)n - 4);
        if (nul == NULL)
            continue;
        size_t tlen = (size_t)(nul - (in + 4)), plen = (size_t)n - (size_t)(nul + 1 - in);
        size_t pos = 0;
        out[pos++] = qos ? 0x32 : 0x30;
        pos += put_length(out + pos, 2 + tlen + (qos ? 2 : 0) + plen);
        out[pos++] = (unsigned char)(tlen >> 8);
        out[pos++] = (unsigned char)tlen;
        memcpy(out + pos, in + 4, tlen);
        pos += tlen;
        if (qos) {
            mid = mid % 0xFFFF + 1;
            out[pos++] = (unsigned char)(mid >> 8);
            out[pos++] = (unsigned char)mid;
        }
        memcpy(out + pos, nul + 1, plen);
        pos += plen;
        for (size_t sent = 0; sent < pos;) {
            ssize_t w = send(mqtt, out + sent, pos - sent, MSG_NOSIGNAL);
            if (w < 0) {
                if (errno == EINTR)
                    continue;
                return -errno;
            }
            sent += (size_t)w;
        }
        while (recv(mqtt, in, sizeof in, MSG_DONTWAIT) > 0) /* PUBACKs, unread */
            ;
    }
}
