import os

import pytest


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("download_fineweb_edu")


@pytest.fixture
def mirror(tmp_path):
    """A local directory laid out like the HuggingFaceFW/fineweb-edu repository."""
    root = tmp_path / "mirror"
    files = {
        "sample/10BT/000_00000.parquet": os.urandom(3000),
        "sample/10BT/001_00000.parquet": os.urandom(5000),
        "sample/100BT/000_00000.parquet": os.urandom(100),
        "data/CC-MAIN-2024-10/train-00000-of-00002.parquet": os.urandom(700),
        "data/CC-MAIN-2024-10/train-00001-of-00002.parquet": os.urandom(800),
        "README.md": b"card",
    }
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root, files


def _run(tool, capsys, *args):
    code = tool.main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_named_subset_downloads_resumes_and_skips(tmp_path, capsys, tool, mirror):
    root, files = mirror
    out = tmp_path / "out"
    wanted = ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]
    # An interrupted earlier run left half of the second file.
    partial = out / (wanted[1] + ".incomplete")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(files[wanted[1]][:2000])
    code, err = _run(tool, capsys, "--name", "sample-10BT", "--output", out, "--source", root)
    assert code == 0, err
    for path in wanted:
        assert (out / path).read_bytes() == files[path]
    assert not partial.exists() and not (out / "sample/100BT").exists()
    code, err = _run(tool, capsys, "--name", "sample-10BT", "--output", out, "--source", root)
    assert code == 0 and err.count("complete, skipped") == 2 and "0 fetched now" in err


def test_wrong_size_file_is_fetched_again(tmp_path, capsys, tool, mirror):
    root, files = mirror
    path = "data/CC-MAIN-2024-10/train-00000-of-00002.parquet"
    stale = tmp_path / "out" / path
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"stale")
    code, err = _run(tool, capsys, "--shards", "data/CC-MAIN-2024-10/*", "--max-files", 1, "--output", tmp_path / "out", "--source", root)
    assert code == 0, err
    assert stale.read_bytes() == files[path]
    assert not (tmp_path / "out" / "data/CC-MAIN-2024-10/train-00001-of-00002.parquet").exists()


def test_unknown_subset_and_missing_source_are_clear_errors(tmp_path, capsys, tool, mirror):
    root, _ = mirror
    code, err = _run(tool, capsys, "--name", "sample-1T", "--output", tmp_path / "o", "--source", root)
    assert code == 2 and err.startswith("error: unknown subset 'sample-1T'")
    code, err = _run(tool, capsys, "--shards", "nothing/*", "--output", tmp_path / "o", "--source", root)
    assert code == 2 and "no parquet files match nothing/*" in err
    code, err = _run(tool, capsys, "--name", "sample-10BT", "--output", tmp_path / "o", "--source", tmp_path / "absent")
    assert code == 2 and "source directory not found" in err


def test_partial_file_longer_than_the_source_is_fetched_again(tmp_path, capsys, tool, mirror):
    root, files = mirror
    path = "sample/10BT/000_00000.parquet"
    partial = tmp_path / "out" / (path + ".incomplete")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(os.urandom(len(files[path]) + 10))  # left by an older, larger version
    code, err = _run(tool, capsys, "--shards", path, "--output", tmp_path / "out", "--source", root)
    assert code == 0, err
    assert (tmp_path / "out" / path).read_bytes() == files[path] and not partial.exists()


def test_bad_arguments_and_an_unwritable_output_are_one_line_errors(tmp_path, capsys, tool,
                                                                      mirror):
    root, _ = mirror
    (tmp_path / "file").write_text("x")
    # Before the fix: a traceback.
    code, err = _run(tool, capsys, "--name", "sample-10BT", "--output", tmp_path / "file" / "o",
                     "--source", root)
    assert code == 2 and err.splitlines()[-1] == f"error: {tmp_path / 'file' / 'o'}: Not a directory"
    # Before the fix: --max-files 0 fetched every file, -1 all but the last; --revision was
    # silently ignored with a local source.
    for args, message in ((["--max-files", "0"], "argument --max-files: 0: must be >= 1"),
                          (["--max-files", "-1"], "argument --max-files: -1: must be >= 1"),
                          (["--revision", "v2"], "--revision v2: a hub revision; --source")):
        with pytest.raises(SystemExit) as exit_:
            tool.main(["--name", "sample-10BT", "--output", str(tmp_path / "o"), "--source",
                       str(root), *args])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_without_huggingface_hub_the_hub_is_one_line(tmp_path, capsys, tool, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # "import" raises ImportError
    code, err = _run(tool, capsys, "--name", "sample-10BT", "--output", tmp_path / "o")
    assert code == 2 and err.startswith("error: the hub needs huggingface_hub, which is not "
                                        "installed")


def test_a_hub_that_never_answers_is_one_line_not_a_hang(tmp_path, capsys, tool, monkeypatch):
    import socket

    from huggingface_hub import constants

    # Before the fix: the listing waited forever (huggingface_hub sets it no timeout).
    with socket.socket() as server:  # connections queue in the backlog; none is ever answered
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        monkeypatch.setattr(tool, "LIST_TIMEOUT_S", 0.5)
        code, err = _run(tool, capsys, "--name", "sample-10BT", "--output", tmp_path / "o")
    assert code == 2 and err == ("error: HuggingFaceFW/fineweb-edu: cannot list the hub "
                                 "repository (timed out)\n")
    assert not (tmp_path / "o").exists()
