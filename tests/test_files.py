"""`sbus.files`: what is found where a small file should be ends in a clear `OSError`,
never a hang (a FIFO) or a read without end (a device, a huge file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sbus.files import NotRegular, must_be_regular, read_small


def test_read_small_reads_regular_files_up_to_the_limit(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"12345")
    assert read_small(f, 5) == b"12345"
    with pytest.raises(NotRegular, match="larger than 4 bytes"):
        read_small(f, 4)
    with pytest.raises(FileNotFoundError):
        read_small(tmp_path / "none", 4)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_read_small_refuses_what_is_not_a_regular_file_at_once(tmp_path: Path, kind) -> None:
    path = {"fifo": tmp_path / "p", "directory": tmp_path, "device": Path("/dev/zero")}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes: an open without O_NONBLOCK waits for good
    with pytest.raises(NotRegular, match="not a regular file"):
        read_small(path, 1 << 20)
    with pytest.raises(NotRegular, match="not a regular file"):
        must_be_regular(None, str(path))


def test_must_be_regular_leaves_missing_and_regular_paths_alone(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    must_be_regular(str(tmp_path / "f"), str(tmp_path / "none"), None)
