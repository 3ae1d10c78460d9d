"""Atomic writes: the target is the old file or the new one, never half of one, and no temporary
outlives a failed write."""

import errno
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaloop.platform.files import (STALE_TEMPORARY_SECONDS, atomic_open, atomic_path,
                                     atomic_write_leftovers, sync_tree, temporaries_in,
                                     write_text_atomic)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_get_the_permissions_of_a_plain_open(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "latest", "iter_0000001\n")
        with atomic_path(tmp_path / "plot.png") as tmp:
            tmp.write_bytes(b"png")  # a writer that opens the path itself (matplotlib, numpy)
    finally:
        os.umask(previous)
    for name in ("latest", "plot.png"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode
    assert (tmp_path / "latest").read_text() == "iter_0000001\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "plot.png"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    target.write_text("old\n")

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError):
        write_text_atomic(target, "new\n")
    monkeypatch.undo()
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["latest"]


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_error_inside_the_block_leaves_the_old_file_and_no_temporary(tmp_path, error):
    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")
    with pytest.raises(error):
        with atomic_open(target) as f:
            f.write("half of the new")
            raise error()
    with pytest.raises(error):
        with atomic_path(target) as tmp:
            tmp.write_text("half of the new")
            raise error()
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_the_file_is_synced_before_its_rename(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or fsync(fd))
    with atomic_open(tmp_path / "tok.model", "wb") as f:
        f.write(b"model")
    assert len(synced) == 1
    assert re.fullmatch(rf"{re.escape(str(tmp_path))}/\.tok\.model-{os.getpid()}-[0-9a-f]{{8}}",
                        synced[0])  # the temporary: synced before it became the target


def test_atomic_open_refuses_a_mode_that_is_not_a_fresh_write(tmp_path):
    with pytest.raises(ValueError, match=r"^atomic_open: mode 'a' \(must be 'w' or 'wb'\)$"):
        with atomic_open(tmp_path / "x", "a"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_write_removes_only_stale_temporaries_of_its_own_path(tmp_path):
    killed = tmp_path / ".config.yaml-4242-0123abcd"  # a write killed before its rename
    live = tmp_path / ".config.yaml-4243-89abcdef"  # a concurrent writer's, being written
    others = [tmp_path / ".run.yaml-4242-0123abcd", tmp_path / ".config.yaml-4242-0123abcd.bak",
              tmp_path / "config.yaml-4242-0123abcd", tmp_path / ".config.yaml-x-0123abcd"]
    old = time.time() - STALE_TEMPORARY_SECONDS - 60
    for p in [killed, live, *others]:
        p.write_text("partial")
        if p is not live:
            os.utime(p, (old, old))
    assert atomic_write_leftovers(tmp_path / "config.yaml") == [killed, live]
    write_text_atomic(tmp_path / "config.yaml", "arch: dense\n")
    assert sorted(tmp_path.iterdir()) == sorted([tmp_path / "config.yaml", live, *others])


KILLED_WRITE = """
import sys, time
from megaloop.platform.files import atomic_open
with atomic_open(sys.argv[1]) as f:
    f.write("iter_0000002\\n")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)  # killed here, between the write and the rename
"""


def test_a_write_killed_through_a_symbolic_link_leaves_a_temporary_clean_up_finds(tmp_path):
    """A link is written through, its temporary beside the target. Before: clean-up looked for
    a link's leftovers beside the link only, so the temporary of a write killed there (SIGKILL)
    stayed for good (a run's `latest` linked to shared storage: every save's clean-up missed it);
    one left beside the link itself stayed through later writes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "pointer").write_text("iter_0000001\n")
    link = tmp_path / "latest"
    link.symlink_to(shared / "pointer")
    beside_link = tmp_path / ".latest-4242-0123abcd"
    beside_link.write_text("partial")
    repo = Path(__file__).resolve().parents[2]
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITE, str(link)], text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert writer.stdout.readline() == "writing\n"
    finally:
        writer.kill()
        writer.wait()
    killed = [p for p in shared.iterdir() if p.name != "pointer"]
    assert len(killed) == 1 and killed[0].name.startswith(f".pointer-{writer.pid}-"), killed
    assert atomic_write_leftovers(link) == [beside_link, killed[0]]
    old = time.time() - STALE_TEMPORARY_SECONDS - 60
    for leftover in (beside_link, killed[0]):
        os.utime(leftover, (old, old))
    write_text_atomic(link, "iter_0000003\n")
    assert link.is_symlink() and link.read_text() == "iter_0000003\n"
    assert sorted(tmp_path.iterdir()) == [link, shared]
    assert list(shared.iterdir()) == [shared / "pointer"]


def test_temporaries_in_a_directory_by_the_suffix_of_their_target(tmp_path):
    names = [".a-doc.npy-12-0123abcd", ".b.npy-3-89abcdef", ".c.txt-12-0123abcd", "a-doc.npy",
             ".a-doc.npy-12-0123abcd.bak"]
    for name in names:
        (tmp_path / name).write_text("x")
    assert [p.name for p in temporaries_in(tmp_path, ".npy")] == names[:2]
    assert [p.name for p in temporaries_in(tmp_path)] == names[:3]
    assert temporaries_in(tmp_path / "missing") == []


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_filesystem_that_cannot_sync_a_directory_still_syncs_the_files(tmp_path, monkeypatch,
                                                                         code):
    # Some network filesystems (CIFS, 9p) have no fsync for a directory: os.fsync says EINVAL or
    # EOPNOTSUPP, as POSIX allows. Their directories are made durable by the server or never;
    # failing every checkpoint save there would lose the checkpoints, not make them safer.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "common.pt").write_bytes(b"x")
    synced, fsync = [], os.fsync

    def no_directory_sync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", no_directory_sync)
    sync_tree(tmp_path)
    assert synced == [str(tmp_path / "sub" / "common.pt")]


def test_a_directory_sync_that_fails_otherwise_is_an_error(tmp_path, monkeypatch):
    def failing(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        sync_tree(tmp_path)
