"""Many packets per system call: ``recvmmsg`` and ``sendmmsg`` through ctypes.

Python's socket module makes one system call per packet, and on a SEQPACKET
socket every message is a packet: per-packet calls were most of the broker's
cost (docs/performance.md).  One `PacketBatch` receives up to ``slots`` packets
into a reusable buffer with one call, and sends any run of them to another socket
with one call, without copying them into Python objects first.

The buffer is overwritten by the next `receive`: whatever must outlive a batch
(packets queued for a slow reader) is copied out with `copy`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import struct
from array import array
from pathlib import Path

__all__ = ["HAS_SEND_EACH", "PacketBatch", "PacketSender", "discard", "peek_offset",
           "peek_past", "start_peeking", "take_heads"]

# plain ints: the socket module's flags are an IntFlag, and `|` on it costs ~0.7 µs
MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
MSG_NOSIGNAL = int(socket.MSG_NOSIGNAL)
MSG_WAITFORONE = 0x10000  # Linux <bits/socket.h>; the socket module does not export it
MSG_PEEK = int(socket.MSG_PEEK)
MSG_TRUNC = int(socket.MSG_TRUNC)
SO_PEEK_OFF = 42  # Linux <asm-generic/socket.h>; the socket module does not export it
_SEND_FLAGS = MSG_DONTWAIT | MSG_NOSIGNAL


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_IOVec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _MsgHdr), ("msg_len", ctypes.c_uint)]


# int recvmmsg(int fd, struct mmsghdr *, unsigned int, int flags, struct timespec *)
# int sendmmsg(int fd, struct mmsghdr *, unsigned int, int flags)
# Called with ints and prepared c_void_p pointers and no argtypes: converting
# arguments through argtypes costs more than the call itself.
_libc = ctypes.CDLL(None, use_errno=True)
_recvmmsg = _libc.recvmmsg
_recvmmsg.restype = ctypes.c_int
_sendmmsg = _libc.sendmmsg
_sendmmsg.restype = ctypes.c_int


def _past_reset(fd: int, msgs, count: int, flags: int) -> int:
    """After a ``recvmmsg`` that failed: the call again if it failed with ECONNRESET,
    else -1 (errno as it was).  A SEQPACKET peer that closed with packets of ours
    unread is reported so once, before the packets it sent, which are still there to
    read, then its end of file: taken for the end, they were lost without a word."""
    if ctypes.get_errno() != errno.ECONNRESET:
        return -1
    return _recvmmsg(fd, msgs, count, flags, None)


def _send_each_helper():
    """``sbus_send_each`` from sbus/_sendeach.c, if tools/setup.sh built it, else None."""
    # the Debian package's dh_python3 renames it with Python's extension suffix
    built = sorted(Path(__file__).parent.glob("_sendeach*.so"))
    try:
        lib = ctypes.CDLL(str(built[0]))
    except (IndexError, OSError):
        return None
    helper = lib.sbus_send_each
    helper.restype = ctypes.c_int
    return helper


_send_each = _send_each_helper()
#: Whether `PacketBatch.send_each` is there (sbus/_sendeach.so was built).
HAS_SEND_EACH = _send_each is not None

_MMSG = ctypes.sizeof(_MMsgHdr)
_SIZE_T = {4: "I", 8: "Q"}[ctypes.sizeof(ctypes.c_size_t)]


def _headers(slots: int, base: int, slot_size: int) -> tuple[ctypes.Array, ctypes.Array]:
    iovs = (_IOVec * slots)()
    msgs = (_MMsgHdr * slots)()
    for i in range(slots):
        iovs[i].iov_base = base + i * slot_size
        iovs[i].iov_len = slot_size
        msgs[i].msg_hdr.msg_iov = ctypes.pointer(iovs[i])
        msgs[i].msg_hdr.msg_iovlen = 1
    return iovs, msgs


class PacketBatch:
    """Up to ``slots`` packets of at most ``slot_size`` bytes each, received in one call.

    After ``n = receive(fd)``, packet ``i < n`` is ``buffer[offsets[i]:offsets[i] +
    lengths[i]]``; a packet longer than ``slot_size`` is cut to ``slot_size`` by the
    kernel, so make ``slot_size`` one more than the largest packet accepted.
    ``received_lengths`` is the same lengths as a view of the kernel's own words
    (``msg_len``), for readers that want them without a list.  The
    buffer is an anonymous mapping: memory the kernel provides only for the pages
    packets actually reach (small packets touch the first page of a slot), and whose
    slices and ``find`` are cheaper than a memoryview's.
    """

    def __init__(self, slots: int, slot_size: int) -> None:
        self.slots = slots
        self.slot_size = slot_size
        self.buffer = mmap.mmap(-1, slots * slot_size, flags=mmap.MAP_PRIVATE)
        self.offsets = [i * slot_size for i in range(slots)]
        self.lengths: list[int] = []
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        # receiving: each header's one iovec is a whole slot
        self._riovs, self._rmsgs = _headers(slots, base, slot_size)
        self._rmsgs_at = ctypes.c_void_p(ctypes.addressof(self._rmsgs))
        words = memoryview(self._rmsgs).cast("B").cast("I")
        stride = _MMSG // 4
        start = _MMsgHdr.msg_len.offset // 4
        self.received_lengths = words[start:start + stride * slots:stride]
        # sending: the same slots, with iovec lengths set to the packets' lengths
        self._siovs, self._smsgs = _headers(slots, base, slot_size)
        at = ctypes.addressof(self._smsgs)
        self._smsgs_at = [ctypes.c_void_p(at + i * _MMSG) for i in range(slots)]
        sizes = memoryview(self._siovs).cast("B").cast(_SIZE_T)
        step = ctypes.sizeof(_IOVec) // sizes.itemsize
        at = _IOVec.iov_len.offset // sizes.itemsize
        self._iov_lens = sizes[at:at + step * slots:step]
        self._sendable = 0  # packets whose send length is set, since the last receive
        self._iov_set: list[int] = []  # the lengths the send iovecs were last given
        self._heads: dict[tuple[int, int], struct.Struct] = {}  # (size, count) -> layout
        # `send_each`: which packet goes to which descriptor, as C ints
        self._picks, self._fds = (ctypes.c_int * slots)(), (ctypes.c_int * slots)()
        self._picks_at = ctypes.c_void_p(ctypes.addressof(self._picks))
        self._fds_at = ctypes.c_void_p(ctypes.addressof(self._fds))
        self._picks_view = memoryview(self._picks).cast("B").cast("i")
        self._fds_view = memoryview(self._fds).cast("B").cast("i")

    def receive(self, fd: int, wait: bool = False, limit: int | None = None,
                peek: bool = False) -> int:
        """Receive what is waiting on *fd*, without blocking: the number of packets.

        Raises BlockingIOError when nothing waits, OSError on failure.  At end of
        file the kernel reports empty packets: a zero length is end of file or an
        empty packet, and only the socket can tell which.

        With *wait*, a blocking socket blocks until the first packet (or its
        ``SO_RCVTIMEO``, then BlockingIOError; a signal raises InterruptedError) and
        then takes what else is waiting: one system call where ``select`` and a
        receive would be two.  *limit*: take at most that many packets.  *peek*: copy
        them and leave them on the socket, past its peek offset (`start_peeking`), for
        `discard` to remove once they are dealt with; a length is then the packet's
        own, also where it was cut to its slot (see `peek_past`).
        """
        count = self.slots if limit is None else limit
        flags = (MSG_WAITFORONE if wait else MSG_DONTWAIT) | (MSG_PEEK | MSG_TRUNC if peek else 0)
        n = _recvmmsg(fd, self._rmsgs_at, count, flags, None)
        if n < 0:
            n = _past_reset(fd, self._rmsgs_at, count, flags)
        if n < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))  # EAGAIN makes it a BlockingIOError
        self.lengths = self.received_lengths[:n].tolist()
        self._sendable = 0
        return n

    def release(self) -> None:
        """Hand the buffer's pages back to the system (between batches only): what
        large packets once touched stays resident otherwise."""
        self.buffer.madvise(mmap.MADV_DONTNEED)

    def trim(self, n: int) -> None:
        """Hand back the pages the first *n* packets do not use (before the batch is
        kept aside: what earlier, larger packets touched would stay resident with it)."""
        page = mmap.PAGESIZE
        lengths, offsets = self.lengths, self.offsets
        for i in range(n):
            start = -(-(offsets[i] + lengths[i]) // page) * page
            end = offsets[i + 1] // page * page if i + 1 < n else len(self.buffer)
            if end > start:
                self.buffer.madvise(mmap.MADV_DONTNEED, start, end - start)

    def copy(self, i: int) -> bytes:
        """Packet *i* as bytes, to keep beyond this batch."""
        at = self.offsets[i]
        return self.buffer[at:at + self.lengths[i]]

    def heads(self, start: int, end: int, size: int) -> tuple[bytes, ...]:
        """The first *size* bytes of the slots of packets ``start .. end-1``, in one call
        (the slots are evenly spaced: one `struct` layout reads them all).  Bytes past a
        packet shorter than *size* are whatever its slot held before."""
        count = end - start
        layout = self._heads.get((size, count))
        if layout is None:
            if len(self._heads) > 256:
                self._heads.clear()
            gap = f"{size}s{self.slot_size - size}x"
            layout = self._heads[size, count] = struct.Struct(gap * (count - 1) + f"{size}s")
        return layout.unpack_from(self.buffer, self.offsets[start])

    def send(self, fd: int, start: int, count: int) -> int:
        """Send packets ``start .. start+count-1`` to *fd* in order, without blocking.

        Returns how many the kernel took (0 when it would block); a failure before the
        first one raises OSError.
        """
        end = start + count
        if self._sendable < end:
            # the iovec lengths of every packet received, in one copy in C, unless they
            # are those of the batch before (a publisher's records are often one size)
            lengths = self.lengths
            if lengths != self._iov_set:
                self._iov_lens[:len(lengths)] = array(_SIZE_T, lengths)
                self._iov_set = lengths
            self._sendable = len(lengths)
        return _send_run(fd, self._smsgs_at[start], count)

    def send_each(self, picks: list[int], fds: list[int]) -> int:
        """Send packet ``picks[k]`` to ``fds[k]``, each in turn, without blocking, in one
        loop in C (sbus/_sendeach.c; only if `HAS_SEND_EACH`).  Returns how many were
        taken before the first that was not; that one's error is not told (send it again
        alone to learn it)."""
        n = len(picks)
        self._picks_view[:n] = array("i", picks)
        self._fds_view[:n] = array("i", fds)
        return _send_each(self._rmsgs_at, n, self._picks_at, self._fds_at)


class PacketSender:
    """Sends a run of packets held as separate ``bytes`` with one ``sendmmsg``: for a
    sender that has many ready at once (a gateway's publishes from one read) and whose
    packets were not received into a `PacketBatch`.  They are joined once and each
    header points into the joined copy, so the kernel sees them as separate packets."""

    def __init__(self, slots: int = 64) -> None:
        self.slots = slots
        self._iovs = (_IOVec * slots)()
        self._msgs = (_MMsgHdr * slots)()
        for i in range(slots):
            self._msgs[i].msg_hdr.msg_iov = ctypes.pointer(self._iovs[i])
            self._msgs[i].msg_hdr.msg_iovlen = 1
        #: (iov_base, iov_len) of every slot as one run of machine words
        self._words = memoryview(self._iovs).cast("B").cast(_SIZE_T)
        self._at = ctypes.c_void_p(ctypes.addressof(self._msgs))

    def send(self, fd: int, packets: list[bytes], start: int = 0) -> int:
        """Send ``packets[start:]`` (at most ``slots`` of them) to *fd* in order, without
        blocking: how many the kernel took (0 when it would block).  A failure before
        the first one raises OSError."""
        run = packets[start:start + self.slots]
        data = b"".join(run)  # held until the call returns: the headers point into it
        address = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
        words = self._words
        i = 0
        for packet in run:
            size = len(packet)
            words[i] = address
            words[i + 1] = size
            address += size
            i += 2
        return _send_run(fd, self._at, len(run))


def _peek_offset(fd: int, to: int | None = None) -> int:
    """The peek offset (``SO_PEEK_OFF``) of socket *fd*, or set it *to* that."""
    sock = socket.socket(fileno=fd)
    try:
        if to is None:
            return sock.getsockopt(socket.SOL_SOCKET, SO_PEEK_OFF)
        sock.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, to)
        return to
    finally:
        sock.detach()  # (the descriptor is the caller's)


def start_peeking(fd: int) -> None:
    """Have reads with ``MSG_PEEK`` on *fd* (`PacketBatch.receive`'s *peek*) go on from
    where the last one ended, from its first packet now: ``SO_PEEK_OFF`` (Linux; on a
    SEQPACKET socket a peek of a whole packet moves it on by one packet).  Also what a
    process that takes over a socket does first: the offset is the socket's, and the
    one before it may have left it anywhere.  OSError where the kernel has no peek
    offset for the socket."""
    _peek_offset(fd, 0)


def peek_offset(fd: int) -> int:
    """Bytes read with ``MSG_PEEK`` from socket *fd* and still on it (-1: it was never
    read so, `start_peeking`): what a process that left it had read and not dealt with."""
    return _peek_offset(fd)


def peek_past(fd: int, lengths: list[int], cut: int, slot_size: int) -> None:
    """After a peek (`PacketBatch.receive`) of packets of *lengths* of which number *cut*
    is the first cut to its slot (*slot_size* bytes or longer): move the socket's peek
    offset to the end of that packet.  The kernel moved it by what it copied, so it read
    the rest of the cut packet as a packet of its own, and more after it: the caller
    keeps packets up to *cut* only."""
    copied = sum(min(size, slot_size) for size in lengths[cut:])
    _peek_offset(fd, _peek_offset(fd) + lengths[cut] - copied)


#: zero-length receive slots: `discard` takes packets off a socket without a copy
_DISCARD_SLOTS = 64
_discard_iovs, _discard_msgs = _headers(_DISCARD_SLOTS, 0, 0)
_discard_at = ctypes.c_void_p(ctypes.addressof(_discard_msgs))


def discard(fd: int, count: int) -> int:
    """Take the next *count* packets off *fd* (a SEQPACKET socket) unread, without
    blocking: those a peek (`PacketBatch.receive`) has read.  Returns how many went
    (fewer when fewer wait); a failure before the first raises OSError."""
    done = 0
    while done < count:
        take = min(count - done, _DISCARD_SLOTS)
        n = _recvmmsg(fd, _discard_at, take, MSG_DONTWAIT, None)
        if n < 0:
            n = _past_reset(fd, _discard_at, take, MSG_DONTWAIT)
        if n < 0:
            code = ctypes.get_errno()
            if code == errno.EAGAIN or done:
                break
            raise OSError(code, os.strerror(code))
        if not n:
            break
        done += n
    return done


def take_heads(fd: int, nbytes: int, size: int = 4) -> list[bytes]:
    """Take packets off the front of *fd* (a SEQPACKET socket) until *nbytes* of them
    are taken (a packet at a time, without blocking), reading only the first *size*
    bytes of each: those heads, in order.  For what an earlier reader left unconfirmed
    (its peek offset: *nbytes*) and is not to be read whole."""
    head = ctypes.create_string_buffer(size)
    iov = _IOVec(ctypes.addressof(head), size)
    msg = _MMsgHdr()
    msg.msg_hdr.msg_iov = ctypes.pointer(iov)
    msg.msg_hdr.msg_iovlen = 1
    at = ctypes.c_void_p(ctypes.addressof(msg))
    heads: list[bytes] = []
    while nbytes > 0:
        n = _recvmmsg(fd, at, 1, MSG_DONTWAIT | MSG_TRUNC, None)
        if n < 0:
            n = _past_reset(fd, at, 1, MSG_DONTWAIT | MSG_TRUNC)
        if n != 1 or not msg.msg_len:
            break  # (nothing more, or the end of the connection)
        heads.append(head.raw[:min(size, msg.msg_len)])
        nbytes -= msg.msg_len
    return heads


def _send_run(fd: int, msgs, count: int) -> int:
    """One non-blocking ``sendmmsg`` of *count* headers at *msgs*: how many the kernel
    took, 0 when it would block; any other failure raises OSError."""
    n = _sendmmsg(fd, msgs, count, _SEND_FLAGS)
    if n < 0:
        code = ctypes.get_errno()
        if code == errno.EAGAIN:
            return 0
        raise OSError(code, os.strerror(code))
    return n
