"""A throwaway notify service for tests/test_fdstore.py, written without sbus or
systemd-python so that it proves the manager's fd store and nothing else.

Generation 1 connects to the listener given as argv[1]; every generation stores that
connection and a memfd holding its generation number in the fd store (sd_notify
FDSTORE=1 with SCM_RIGHTS), says which fds it got back on the connection, then waits
for SIGTERM.  A restarted generation finds both in LISTEN_FDS/LISTEN_FDNAMES."""

import array
import os
import signal
import socket
import sys

notify_path = os.environ["NOTIFY_SOCKET"]
if notify_path.startswith("@"):
    notify_path = "\0" + notify_path[1:]
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify.connect(notify_path)


def tell(text: bytes, fds: list[int] = ()) -> None:
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    notify.sendmsg([text], rights if fds else [])


ours = os.environ.get("LISTEN_PID") == str(os.getpid())
names = os.environ.get("LISTEN_FDNAMES", "").split(":") if ours else []
got = {name: 3 + i for i, name in enumerate(names) if name}
if "client" in got:
    conn = socket.socket(fileno=got["client"])
    generation = int(os.pread(got["state"], 32, 0)) + 1
else:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(sys.argv[1])
    generation = 1
state = os.memfd_create("state")
os.write(state, b"%d" % generation)
tell(b"FDSTORE=1\nFDNAME=client", [conn.fileno()])
if "state" in got:
    tell(b"FDSTOREREMOVE=1\nFDNAME=state")
tell(b"FDSTORE=1\nFDNAME=state", [state])
conn.send(b"generation %d got %s" % (generation, ",".join(sorted(got)).encode() or b"-"))
tell(b"READY=1")
signal.sigwait([signal.SIGTERM])
