import json
import re

import pytest

from megaloop.training.monitor import Monitor
from megaloop.training import plots
from tools import plot_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(run_dir, loss_scale, with_eval=True):
    """A run directory written by the real Monitor: 6 train steps and, optionally, 2 evaluations."""
    with Monitor(run_dir, is_writer=True, total_steps=6, tokens_per_step=1024, model_flops_per_token=1e6,
                 world_size=1, tensorboard=False, progress=False, log_interval=3) as m:
        for step in range(1, 7):
            m.log_step(step, loss=loss_scale / step, lr=1e-3 * step / 6, grad_norm=1.0,
                       step_time_s=0.1 * step, skipped=False)
            if with_eval and step % 3 == 0:
                m.log_eval(step, {"val_loss": loss_scale / step + 0.1, "val_ppl": 2.0})
    return run_dir


def _error(argv, capsys) -> str:
    """The one stderr line of a refused plot_metrics run, which exits with code 2."""
    capsys.readouterr()
    assert plot_metrics.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


def test_two_runs_give_one_png(tmp_path):
    a = _run(tmp_path / "dense", 4.0)
    b = _run(tmp_path / "asymloop", 3.0, with_eval=False)
    out = tmp_path / "plots" / "curves.png"
    assert plot_metrics.main([str(a), str(b), "--out", str(out)]) == 0
    _assert_png(out)
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no .tmp left behind


def test_loaded_series_follow_the_log(tmp_path):
    train, evals = plots.load_run(_run(tmp_path / "dense", 6.0))
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in evals] == [3, 6]
    steps, losses = plots._series(train, "loss")
    assert steps == [1, 2, 3, 4, 5, 6] and losses == [6.0, 3.0, 2.0, 1.5, 1.2, 1.0]
    assert plots._series(train, "tokens_per_s")[1][0] == pytest.approx(10240.0)


def test_missing_file_is_a_one_line_error(tmp_path, capsys):
    a = _run(tmp_path / "dense", 4.0)
    message = _error([str(a), str(tmp_path / "nope"), "--out", str(tmp_path / "c.png")], capsys)
    assert f"{tmp_path / 'nope' / 'metrics.jsonl'}: no such file" in message
    assert not (tmp_path / "c.png").exists()


def test_empty_and_garbled_files_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "metrics.jsonl").write_text("not json\n[1, 2]\n{\"kind\": \"train\"}\n")
    assert _error([str(tmp_path / "empty")], capsys).endswith("empty/metrics.jsonl: file is empty")
    assert _error([str(tmp_path / "garbled")], capsys).endswith(
        "garbled/metrics.jsonl: no train or eval records (0 other, 3 malformed line(s))")
    # Before: "no readable metric lines (0 malformed)", of a file of readable lines.
    (tmp_path / "downstream").mkdir()
    (tmp_path / "downstream" / "metrics.jsonl").write_text('{"kind": "downstream", "step": 3}\n')
    assert _error([str(tmp_path / "downstream")], capsys).endswith(
        "downstream/metrics.jsonl: no train or eval records (1 other, 0 malformed line(s))")


def test_half_written_last_line_and_null_loss_are_tolerated(tmp_path, capsys):
    run = _run(tmp_path / "crashed", 4.0)
    with open(run / "metrics.jsonl", "a") as f:
        skipped = {"kind": "train", "step": 7, "loss": None, "lr": 1e-3, "tokens_per_s": 9.0}
        f.write(json.dumps(skipped) + "\n")
        f.write('{"kind": "train", "step": 8, "loss": 0.')
    out = tmp_path / "curves.png"
    plot_metrics.main([str(run), "--out", str(out)])
    _assert_png(out)
    assert "crashed/metrics.jsonl: skipped 1 malformed line(s)" in capsys.readouterr().err
    steps, losses = plots._series(plots.load_run(run)[0], "loss")
    assert steps[-1] == 7 and losses[-1] != losses[-1]  # null -> NaN, a gap in the curve


def test_a_run_given_twice_is_a_one_line_error(tmp_path, capsys):
    """Before: its curves drawn twice, under two labels, exit 0."""
    run = _run(tmp_path / "dense", 4.0)
    assert _error([str(run), f"{run}/", "--out", str(tmp_path / "c.png")], capsys) == \
        f"error: {run}/: given twice"
    assert not (tmp_path / "c.png").exists()


def test_labels_are_dir_names_unless_they_clash(tmp_path):
    assert plots.run_labels(["runs/a", "runs/b/"]) == ["a", "b"]
    assert plots.run_labels(["x/run", "y/run"]) == ["x/run", "y/run"]


def test_an_out_path_that_cannot_be_written_is_a_one_line_error_leaving_nothing(tmp_path, capsys):
    run = _run(tmp_path / "runs" / "dense", 4.0)
    target = tmp_path / "plots"
    target.mkdir()
    # Before the fix: tracebacks, and a stray plots.tmp beside the directory.
    metrics = tmp_path / "runs" / "dense" / "metrics.jsonl"
    for out, reason in ((target, "it is a directory"),
                        (metrics / "c.png", f"{metrics} is not a writable directory")):
        assert _error([str(run), "--out", str(out)], capsys) == \
            f"error: --out {out}: cannot be written ({reason})"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "runs"]
    assert not list(target.iterdir())


def test_a_failed_write_is_a_one_line_error_leaving_no_temporary(tmp_path, monkeypatch, capsys):
    import errno

    run = _run(tmp_path / "dense", 4.0)

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plots.os, "replace", full_disk)
    assert _error([str(run), "--out", str(tmp_path / "out" / "c.png")], capsys).endswith(
        "c.png: cannot be written (No space left on device)")
    assert not list((tmp_path / "out").iterdir())


def test_the_image_format_follows_the_file_name(tmp_path, capsys):
    run = _run(tmp_path / "dense", 4.0)
    plot_metrics.main([str(run), "--out", str(tmp_path / "c.svg")])
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    assert re.search(r"c.xyz: cannot be written \(.*c.xyz: matplotlib writes no .xyz files "
                     r"\(it writes .*png", _error([str(run), "--out", str(tmp_path / "c.xyz")],
                                                  capsys))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.svg", "dense"]
