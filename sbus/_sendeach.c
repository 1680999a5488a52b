/* sbus/_sendeach.c - the broker's one optional piece of C (built by tools/setup.sh,
 * loaded by sbus/packetio.py through ctypes; without it the broker writes the same
 * packets from Python, correctly but with more CPU per delivery).
 *
 * Many keys in turn (one publisher, a subscriber per key) make one write per packet,
 * each to another socket, so no sendmmsg can take two of them.  Python between two
 * writes cost the broker more kernel time per write than the writes themselves: this
 * loop writes a routed batch back to back (docs/performance.md, issue 26).
 */
#define _GNU_SOURCE
#include <sys/socket.h>

/* Send packet picks[k] of a batch received by recvmmsg (msgs: its headers, whose one
 * iovec is the packet's slot and msg_len its length) to fds[k], for k = 0 .. n-1 in
 * order, without blocking.  Returns how many were taken before the first send that
 * failed (that one and the rest are the caller's to retry, and to learn why). */
int sbus_send_each(const struct mmsghdr *msgs, int n, const int *picks, const int *fds)
{
    for (int k = 0; k < n; k++) {
        const struct mmsghdr *m = &msgs[picks[k]];
        if (send(fds[k], m->msg_hdr.msg_iov->iov_base, m->msg_len,
                 MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
            return k;
    }
    return n;
}
