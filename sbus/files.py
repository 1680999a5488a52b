"""Reading the small files a component is given or keeps (a key, a configuration, saved
state): what is found at the path may be anything, and must end in a clear error, not a
hang or a traceback.  A FIFO would block the open (and the reader with it) for good, a
device or a huge file would be read without end; both are refused before reading."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["read_small", "must_be_regular", "NotRegular", "SECRET_BYTES"]

#: A key or password file is read up to this size: a larger one is not one.
SECRET_BYTES = 64 * 1024


class NotRegular(OSError):
    """The path names something other than a regular file, or one over the size limit
    (its ``strerror`` says which: callers print it like any `OSError`'s)."""


def read_small(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file at *path*, at most *limit* of them; `OSError` when it
    cannot be read (`NotRegular` when it is not such a file, or larger)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO: no wait)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, "not a regular file")
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
