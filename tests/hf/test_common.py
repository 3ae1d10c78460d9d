"""The staged output directory both conversion directions write into."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.hf.common import ConversionError, _host, staged_output


def test_a_staging_directory_a_killed_conversion_left_is_named_with_its_size(tmp_path, caplog):
    """Before: not a word; nothing removes it (a SIGKILL cannot be caught: the out-of-memory
    killer), and it holds a model's weights. It is not removed, and the line does not claim the
    conversion was killed: one still running (here or on another node) has the same name."""
    killed = tmp_path / ".hf.tmp-4242-0123abcd"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"\0" * 20_000_000)
    others = [tmp_path / ".hf2.tmp-4243-89abcdef", tmp_path / ".hf.tmp-x-0123abcd"]
    for other in others:
        other.mkdir()
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        with staged_output(tmp_path / "hf") as staging:
            (staging / "config.json").write_text("{}")
    assert [r.getMessage() for r in caplog.records] == [
        f"{killed} (20.0 MB): the staging directory of a conversion into {tmp_path / 'hf'} by "
        "process 4242, which was killed or is still running; not removed: remove it unless that "
        "conversion is running"]
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"
    assert sorted(tmp_path.iterdir()) == sorted([killed, *others, tmp_path / "hf"])


@pytest.mark.parametrize("size, shown", [(0, "0 bytes"), (700, "700 bytes"), (1_500, "1.5 KB"),
                                         (3_210_000_000, "3.2 GB")])
def test_a_staging_directory_left_is_named_with_a_size_in_its_unit(tmp_path, caplog, size, shown):
    """Before: "(0.00 GB)" for a leftover of some KB (a killed conversion's config files only),
    which reads as empty."""
    killed = tmp_path / ".hf.tmp-4242-0123abcd"
    killed.mkdir()
    with open(killed / "model.safetensors", "wb") as weights:
        weights.truncate(size)  # sparse: its size, no bytes written
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        with staged_output(tmp_path / "hf"):
            pass
    assert caplog.records[0].getMessage().startswith(f"{killed} ({shown}): the staging")


def test_a_running_conversion_finishing_while_its_staging_is_measured_is_no_traceback(
        tmp_path, caplog, monkeypatch):
    """Another conversion into the same OUT moves its staging directory into place while this
    one measures it. Before: FileNotFoundError from the measuring, a traceback; now the line a
    conversion whose OUT was written meanwhile gets, and no warning of a directory now gone."""
    running = tmp_path / ".hf.tmp-4242-0123abcd"
    running.mkdir()
    (running / "config.json").write_text('{"theirs": 1}')
    is_file = Path.is_file

    def finishes_after_listing(path):
        found = is_file(path)
        if path.parent == running:
            running.rename(tmp_path / "hf")
        return found

    monkeypatch.setattr(Path, "is_file", finishes_after_listing)
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        with pytest.raises(ConversionError, match="cannot move the conversion there"):
            with staged_output(tmp_path / "hf") as staging:
                (staging / "config.json").write_text("{}")
    assert caplog.records == []
    assert (tmp_path / "hf" / "config.json").read_text() == '{"theirs": 1}'


def test_a_staging_directory_on_this_host_is_named_running_or_killed_by_its_process(tmp_path,
                                                                                    caplog):
    """The staging name holds the host and process. Before: a running conversion's staging
    directory (here: this process's) was reported as a killed one's leftover, "remove it", as
    was one whose process has ended; now each says which it is. Another host's cannot be told."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = _host()
    running = tmp_path / f".hf.tmp-{host}-{os.getpid()}-0123abcd"
    killed = tmp_path / f".hf.tmp-{host}-{ended.pid}-89abcdef"
    elsewhere = tmp_path / f".hf.tmp-{host}x-4242-00000000"
    for directory in (running, killed, elsewhere):
        directory.mkdir()
    out = tmp_path / "hf"
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        with staged_output(out) as staging:
            assert staging.name.startswith(f".hf.tmp-{host}-{os.getpid()}-")
    assert sorted(r.getMessage() for r in caplog.records) == sorted([
        f"{running} (0 bytes): the staging directory of a conversion into {out} by process "
        f"{os.getpid()} on this host, still running: of the two conversions into it, the later "
        "to finish will be refused",
        f"{killed} (0 bytes): the staging directory of a conversion into {out} by process "
        f"{ended.pid} on this host, which has ended (killed); not removed: remove it",
        f"{elsewhere} (0 bytes): the staging directory of a conversion into {out} by process 4242 "
        f"on host {host}x, which was killed or is still running; not removed: remove it unless "
        "that conversion is running"])


def test_a_conversion_ended_by_sigterm_removes_its_staging_directory(tmp_path):
    """Before: SIGTERM (timeout, kill, a scheduler's time limit) ended the process on the spot and
    left the staging directory, as large as a model, beside OUT; now it is removed, a line says
    so, and the exit status is SIGTERM's (143)."""
    script = ("import pathlib, sys, time\n"
              "from megaloop.hf.common import staged_output\n"
              "with staged_output(sys.argv[1]) as staging:\n"
              "    (staging / 'model.safetensors').write_bytes(b'0' * 1000)\n"
              "    print('ready', flush=True)\n"
              "    time.sleep(60)\n")
    out = tmp_path / "hf"
    process = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert process.stdout.readline() == "ready\n"
    process.terminate()
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143
    assert f"{out}: terminated (SIGTERM): the conversion stopped, nothing was written" in stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("given", [".", "../here"])
def test_the_current_directory_as_output_is_refused_in_one_line(tmp_path, monkeypatch, given):
    """Before: '.' was a ValueError traceback from pathlib (exit 1, as for a probe mismatch), and
    '../here' from inside it renamed the result over the shell's working directory, which then
    listed nothing."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(ConversionError, match=rf"^{re.escape(given)}: the current directory, "
                                              "which the result would replace"):
        with staged_output(given):
            pass
    assert list(tmp_path.iterdir()) == [tmp_path / "here"]
