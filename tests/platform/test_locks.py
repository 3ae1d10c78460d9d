"""take_flock: the one exclusive-lock step of run directories and the dataset index cache."""

import errno
import fcntl
import os
import socket
import threading

import pytest

from megaloop.platform.locks import take_flock


def _never(*args):
    raise AssertionError("not expected")


def test_a_free_lock_is_taken_and_names_its_holder(tmp_path):
    with open(tmp_path / "lock", "a+") as f:
        f.write("pid 1 on gone since yesterday\n")  # a dead holder's record is replaced
        f.flush()
        assert take_flock(f, _never, _never)
    record = (tmp_path / "lock").read_text()
    assert record.startswith(f"pid {os.getpid()} on {socket.gethostname()} since ")


def test_a_held_lock_is_refused_with_its_holder_when_asked(tmp_path):
    with open(tmp_path / "lock", "a+") as holder, open(tmp_path / "lock", "a+") as second:
        assert take_flock(holder, _never, _never)

        def refuse(who):
            raise RuntimeError(f"held by {who}")

        with pytest.raises(RuntimeError, match=rf"^held by pid {os.getpid()} on "):
            take_flock(second, refuse, _never)
        holder.seek(0)
        assert holder.read().startswith(f"pid {os.getpid()} ")  # untouched by the refused one


def test_a_held_lock_is_waited_for_when_asked(tmp_path):
    with open(tmp_path / "lock", "a+") as holder, open(tmp_path / "lock", "a+") as second:
        assert take_flock(holder, _never, _never)
        told = []

        def wait(who):  # the holder ends once the waiter has said whom it waits for
            told.append(who)
            threading.Timer(0.2, holder.close).start()

        assert take_flock(second, wait, _never)
        assert len(told) == 1 and told[0].startswith(f"pid {os.getpid()} ")


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_filesystem_without_locks_is_unguarded(tmp_path, monkeypatch, error):
    def no_locks(*args):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    reasons = []
    with open(tmp_path / "lock", "a+") as f:
        assert not take_flock(f, _never, reasons.append)
    assert reasons == [os.strerror(error)]

    def io_error(*args):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fcntl, "flock", io_error)
    with open(tmp_path / "lock", "a+") as f, pytest.raises(OSError, match="I/O error"):
        take_flock(f, _never, _never)
