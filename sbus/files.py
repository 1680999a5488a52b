"""Reading the small files a component is given or keeps (a key, a configuration, saved
state): what is found at the path may be anything, and must end in a clear error, not a
hang or a traceback.  A FIFO would block the open (and the reader with it) for good, a
device or a huge file would be read without end; both are refused before reading."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["open_regular", "read_small", "must_be_regular", "NotRegular", "SECRET_BYTES"]

#: A key or password file is read up to this size: a larger one is not one.
SECRET_BYTES = 64 * 1024


class NotRegular(OSError):
    """The path names something other than a regular file, or one over the size limit
    (its ``strerror`` says which: callers print it like any `OSError`'s)."""


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor on the regular file at *path*: opened without waiting (a FIFO put
    there, even after a listing, would block the open for good) and checked on the
    descriptor, not the name.  `NotRegular` for another kind of file (a directory:
    ``errno`` EISDIR), `OSError` when it cannot be opened."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)  # (*mode*: if created)
    kind = os.fstat(fd).st_mode
    if stat.S_ISREG(kind):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    raise NotRegular(errno.EISDIR if stat.S_ISDIR(kind) else errno.EINVAL,
                     "not a regular file", str(path))


def read_small(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file at *path*, at most *limit* of them; `OSError` when it
    cannot be read (`NotRegular` when it is not such a file, or larger)."""
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise NotRegular(errno.EFBIG, f"larger than {limit} bytes ({st.st_size})")
        chunks = []
        left = limit + 1  # (one more: a file that grew meanwhile is over the limit too)
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise NotRegular(errno.EFBIG, f"larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def must_be_regular(*paths: str | None) -> None:
    """Raise `NotRegular` (with the path as its ``filename``) for the first of *paths* that
    names something other than a regular file, before a library opens it by name (a FIFO
    there would block it for good); paths that name nothing are left to that library."""
    for path in paths:
        if path is None:
            continue
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise NotRegular(errno.EINVAL, "not a regular file", path)
