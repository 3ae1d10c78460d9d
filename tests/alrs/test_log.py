import numpy as np
import pytest
import torch
import zarr

from megaloop.alrs import ALRSLog, read_log

NAMES = ["encoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.weight"]
SHAPES = [(6, 4), (3, 5)]
GROUPS = NAMES + ["base"]


def _stats(k):
    return {"alpha": [2.0 + k, np.nan], "multiplier": [1.0, 5.0 - k],
            "stable_rank": [1.5, 2.5], "norm_stable_rank": [0.375, 0.5 + k]}


def _eigs(k):
    return {NAMES[0]: np.arange(4.0) + k, NAMES[1]: np.arange(3.0) * k}


def test_round_trip(tmp_path):
    log = ALRSLog(tmp_path / "r.zarr", NAMES, SHAPES, GROUPS, {"s2": 5.0}, log_eigenvalues=True,
                  flush_every=3)
    for k, step in enumerate([1, 100]):
        log.append_spectra(step, k == 0, _stats(k), _eigs(k))
    for step in range(1, 8):
        log.append_lrs(step, {NAMES[0]: 1e-3 * step, "base": 2e-3})
    log.flush()
    data = read_log(tmp_path / "r.zarr")
    assert data.matrices == NAMES and data.shapes == SHAPES and data.config == {"s2": 5.0}
    assert data.spectra_step.tolist() == [1, 100] and data.allocated.tolist() == [True, False]
    np.testing.assert_array_equal(data.alpha, [[2.0, np.nan], [3.0, np.nan]])
    np.testing.assert_array_equal(data.multiplier[:, 1], [5.0, 4.0])
    np.testing.assert_array_equal(data.norm_stable_rank[:, 1], [0.5, 1.5])
    np.testing.assert_array_equal(data.eigenvalues[NAMES[0]], [np.arange(4.0), np.arange(4.0) + 1])
    assert data.lr_groups == GROUPS and data.lr_step.tolist() == list(range(1, 8))
    np.testing.assert_allclose(data.lr_value[:, 0], 1e-3 * np.arange(1, 8))
    assert np.isnan(data.lr_value[:, 1]).all() and (data.lr_value[:, 2] == 2e-3).all()


def test_a_reopened_log_holds_the_config_of_the_run_writing_it(tmp_path):
    # Before: a uniform run started over in an ALRS run's directory kept "mode: alrs" in its log.
    ALRSLog(tmp_path / "r.zarr", NAMES, SHAPES, GROUPS, {"mode": "alrs"})
    ALRSLog(tmp_path / "r.zarr", NAMES, SHAPES, GROUPS, {"mode": "uniform"}).truncate_after(0)
    assert read_log(tmp_path / "r.zarr").config == {"mode": "uniform"}
    ALRSLog(tmp_path / "r.zarr", NAMES, SHAPES, GROUPS)  # no config given: the store's stays
    assert read_log(tmp_path / "r.zarr").config == {"mode": "uniform"}


def test_reader_ignores_rows_past_the_committed_count_and_appends_overwrite_them(tmp_path):
    path = tmp_path / "c.zarr"
    log = ALRSLog(path, NAMES, SHAPES, GROUPS)
    log.append_spectra(1, True, _stats(0))
    # A crash after the rows were written but before the count was committed:
    root = zarr.open_group(path, mode="a")
    root["spectra/step"].resize((2,))
    root["spectra/step"][1] = 999
    assert read_log(path).spectra_step.tolist() == [1]
    reopened = ALRSLog(path, NAMES, SHAPES, GROUPS)
    reopened.append_spectra(100, True, _stats(1))
    assert read_log(path).spectra_step.tolist() == [1, 100]


def test_lr_rows_reach_the_store_only_when_flushed(tmp_path):
    path = tmp_path / "f.zarr"
    log = ALRSLog(path, NAMES, SHAPES, GROUPS, flush_every=4)
    for step in range(1, 7):
        log.append_lrs(step, {"base": 1.0})
    assert read_log(path).lr_step.tolist() == [1, 2, 3, 4]  # a crash now loses only 5 and 6
    log.flush()
    assert read_log(path).lr_step.tolist() == list(range(1, 7))


def test_resume_truncates_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "t.zarr"
    log = ALRSLog(path, NAMES, SHAPES, GROUPS, flush_every=1)
    for step in (1, 100, 200):
        log.append_spectra(step, True, _stats(0))
    for step in range(1, 251):
        log.append_lrs(step, {"base": float(step)})
    resumed = ALRSLog(path, NAMES, SHAPES, GROUPS, flush_every=1)
    resumed.truncate_after(150)
    resumed.append_lrs(151, {"base": -1.0})
    data = read_log(path)
    assert data.spectra_step.tolist() == [1, 100]
    assert data.lr_step.tolist() == list(range(1, 152)) and data.lr_value[-1, 2] == -1.0


def test_refuses_another_models_log_and_unknown_groups(tmp_path):
    path = tmp_path / "m.zarr"
    log = ALRSLog(path, NAMES, SHAPES, GROUPS)
    with pytest.raises(ValueError, match="other matrices"):
        ALRSLog(path, NAMES[:1], SHAPES[:1], GROUPS)
    with pytest.raises(ValueError, match="no LR group"):
        log.append_lrs(1, {"decoder.typo": 1.0})
    (tmp_path / "other").mkdir()
    zarr.open_group(tmp_path / "other", mode="w").attrs["format"] = "something-else"
    with pytest.raises(ValueError, match="not an ALRS log"):
        ALRSLog(tmp_path / "other", NAMES, SHAPES, GROUPS)
    with pytest.raises(ValueError, match="not an ALRS log"):
        read_log(tmp_path / "other")


@pytest.mark.parametrize("first", [False, True])
def test_reopening_with_the_other_eigenvalue_setting_is_refused_in_one_line(tmp_path, first):
    ALRSLog(tmp_path / "r.zarr", NAMES, SHAPES, GROUPS, log_eigenvalues=first)
    # Before the fix the store's setting silently won (no eigenvalues, or eigenvalues anyway).
    with pytest.raises(ValueError) as error:
        ALRSLog(tmp_path / "r.zarr", NAMES, SHAPES, GROUPS, log_eigenvalues=not first)
    assert str(error.value) == (  # worded as the resume check's refusal (training.resume)
        f"alrs.log_eigenvalues={not first}: the ALRS log {tmp_path / 'r.zarr'} holds eigenvalues "
        f"for {'every' if first else 'no'} analysis, which cannot change within it; set it back, "
        "or use another train.out_dir (a new log)")


def test_a_damaged_log_is_one_line_naming_it(tmp_path):
    """Before: JSONDecodeError, KeyError and zstd RuntimeError tracebacks (plot_alrs), and a
    training start that refused with "Expecting property name ..." naming no file."""
    import shutil

    from megaloop.alrs import ALRS

    good = tmp_path / "good.zarr"
    log = ALRSLog(good, NAMES, SHAPES, GROUPS)
    log.append_spectra(1, True, _stats(0))
    broken = {name: tmp_path / f"{name}.zarr" for name in ("json", "array", "chunk")}
    for path in broken.values():
        shutil.copytree(good, path)
    (broken["json"] / "zarr.json").write_text("{half-written")
    shutil.rmtree(broken["array"] / "spectra" / "alpha")
    [chunk] = [p for p in (broken["chunk"] / "spectra" / "alpha" / "c").rglob("*") if p.is_file()]
    chunk.write_bytes(chunk.read_bytes()[:5])
    for name, detail in (("json", "(Expecting property name"),
                         ("array", "(KeyError: 'spectra/alpha')"), ("chunk", "(RuntimeError: ")):
        with pytest.raises(ValueError) as error:
            read_log(broken[name])
        assert str(error.value).startswith(f"{broken[name]}: not a readable ALRS log {detail}")
        assert "\n" not in str(error.value)
    weights = {NAMES[0]: torch.nn.Parameter(torch.randn(6, 4))}
    with pytest.raises(ValueError, match=rf"^{broken['json']}: not a readable ALRS log \("):
        ALRS(lambda: weights.items(), 10, log_path=broken["json"])
