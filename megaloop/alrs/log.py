"""The ALRS zarr v3 log of one run: spectra per analysis step and the LR of every group per step.

Layout (M matrices, A analysis rows, S LR rows, G LR groups):

    spectra/step [A] int64, spectra/allocated [A] bool (False: logged only, multipliers frozen)
    spectra/alpha, multiplier, stable_rank, norm_stable_rank [A, M] float64
        (multiplier is the target the matrix ramps to after that step)
    eigenvalues/<i> [A, min(m_i, n_i)] float64, ascending, only with log_eigenvalues
    lr/step [S] int64, lr/value [S, G] float64

Crash safety: rows are written first and the committed row counts (root attributes ``n_spectra``
and ``n_lr``) last. zarr's local store replaces files atomically, so a crash leaves either the old
or the new count, and readers never look past the count. Rows past it are overwritten by the next
append. LR rows are buffered and flushed every ``flush_every`` steps and whenever a checkpoint
takes ALRS's state (``ALRS.state_dict``), so a crash loses only rows after the last checkpoint,
which the resumed run writes again, never the store.

zarr is imported only when a log is opened, so that megaloop (and ALRS without a log) works on a
machine without zarr; opening a log there is one clear ``ConfigError``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megaloop.alrs.schedule import config_error

FORMAT = "megaloop.alrs.log/1"
RUN_LOG = "alrs.zarr"  # a training run's log: <train.out_dir>/alrs.zarr
_STAT_FIELDS = ("alpha", "multiplier", "stable_rank", "norm_stable_rank")
_ROWS_PER_CHUNK = 256


def require_zarr():
    """The zarr module, or a one-line error saying how to get it."""
    try:
        import zarr
    except ImportError:
        raise config_error("the ALRS log (train.use_alrs=true, or ALRS(log_path=...)) is "
                           "written with zarr, which is not installed: pip install 'zarr>=3'"
                           ) from None
    return zarr


@dataclass
class ALRSLogData:
    """Everything committed to a log, as NumPy arrays."""

    matrices: list[str]
    shapes: list[tuple[int, int]]
    config: dict
    spectra_step: np.ndarray
    allocated: np.ndarray
    alpha: np.ndarray
    multiplier: np.ndarray
    stable_rank: np.ndarray
    norm_stable_rank: np.ndarray
    eigenvalues: dict[str, np.ndarray]
    lr_groups: list[str]
    lr_step: np.ndarray
    lr_value: np.ndarray


class ALRSLog:
    """Appends to (or creates) the store at ``path``; one writer per run (rank 0)."""

    def __init__(self, path: str | os.PathLike, matrices: Sequence[str],
                 shapes: Sequence[tuple[int, int]], lr_groups: Sequence[str],
                 config: Mapping | None = None, log_eigenvalues: bool = False,
                 flush_every: int = 100):
        self.path = os.fspath(path)
        self.flush_every = flush_every
        self._pending: list[tuple[int, list[float]]] = []
        zarr = require_zarr()
        existing = None
        if os.path.exists(os.path.join(self.path, "zarr.json")):
            existing = _open_group(self.path).attrs.get("format")
            if existing not in (None, FORMAT):
                raise config_error(f"{self.path} is not an ALRS log (format {existing!r})")
        # A store without "format" is an interrupted creation: start it again.
        self.root = zarr.open_group(self.path, mode="a" if existing else "w")
        if existing:
            self._check_same_run(matrices, shapes, lr_groups, log_eigenvalues)
            if config is not None:  # the run now writing (a restart may use another alrs.mode)
                self.root.attrs["config"] = dict(config)
        else:
            self._create(list(matrices), [list(map(int, s)) for s in shapes], list(lr_groups),
                         dict(config or {}), log_eigenvalues)
        self.matrices = list(self.root.attrs["matrices"])
        self.lr_groups = list(self.root.attrs["lr_groups"])
        self._group_index = {g: i for i, g in enumerate(self.lr_groups)}
        self.log_eigenvalues = bool(self.root.attrs["log_eigenvalues"])

    def _create(self, matrices, shapes, lr_groups, config, log_eigenvalues) -> None:
        m, g = len(matrices), len(lr_groups)
        self.root.create_array("spectra/step", shape=(0,), chunks=(_ROWS_PER_CHUNK,), dtype="int64")
        self.root.create_array("spectra/allocated", shape=(0,), chunks=(_ROWS_PER_CHUNK,),
                               dtype="bool")
        for name in _STAT_FIELDS:
            self.root.create_array(f"spectra/{name}", shape=(0, m), chunks=(16, max(m, 1)),
                                   dtype="float64", fill_value=np.nan)
        if log_eigenvalues:
            for i, shape in enumerate(shapes):
                self.root.create_array(f"eigenvalues/{i}", shape=(0, min(shape)),
                                       chunks=(1, min(shape)), dtype="float64", fill_value=np.nan)
        self.root.create_array("lr/step", shape=(0,), chunks=(_ROWS_PER_CHUNK * 4,), dtype="int64")
        self.root.create_array("lr/value", shape=(0, g), chunks=(_ROWS_PER_CHUNK * 4, max(g, 1)),
                               dtype="float64", fill_value=np.nan)
        # Attributes last, so that "format" marks a completely created store.
        self.root.attrs.update({"matrices": matrices, "shapes": shapes, "lr_groups": lr_groups,
                                "config": config, "log_eigenvalues": log_eigenvalues,
                                "n_spectra": 0, "n_lr": 0, "format": FORMAT})

    def _check_same_run(self, matrices, shapes, lr_groups, log_eigenvalues) -> None:
        attrs = self.root.attrs
        if (list(attrs["matrices"]) != list(matrices)
                or [tuple(s) for s in attrs["shapes"]] != [tuple(map(int, s)) for s in shapes]
                or list(attrs["lr_groups"]) != list(lr_groups)):
            raise config_error(f"ALRS log {self.path} belongs to a run with other matrices "
                               "(another model, alrs.granularity or alrs.exclude): use another "
                               "train.out_dir")
        if bool(attrs["log_eigenvalues"]) != bool(log_eigenvalues):
            raise config_error(f"alrs.log_eigenvalues={bool(log_eigenvalues)}: "
                               f"{eigenvalue_setting_fixed(self.path, attrs['log_eigenvalues'])}"
                               "; set it back, or use another train.out_dir (a new log)")

    def append_spectra(self, step: int, allocated: bool, stats: Mapping[str, Sequence[float]],
                       eigenvalues: Mapping[str, np.ndarray] | None = None) -> None:
        """One analysis row; ``stats[field]`` lists one value per matrix, in ``matrices`` order."""
        row = int(self.root.attrs["n_spectra"])
        self._write_row("spectra/step", row, np.int64(step))
        self._write_row("spectra/allocated", row, np.bool_(allocated))
        for name in _STAT_FIELDS:
            self._write_row(f"spectra/{name}", row, np.asarray(stats[name], dtype=np.float64))
        if self.log_eigenvalues and eigenvalues is not None:
            for i, matrix in enumerate(self.matrices):
                self._write_row(f"eigenvalues/{i}", row, np.asarray(eigenvalues[matrix]))
        self.root.attrs["n_spectra"] = row + 1

    def append_lrs(self, step: int, lrs: Mapping[str, float]) -> None:
        """The LR of each named group at ``step``; groups not given are stored as NaN."""
        unknown = set(lrs) - self._group_index.keys()
        if unknown:
            raise ValueError(f"ALRS log has no LR group(s) {sorted(unknown)[:3]}")
        values = [np.nan] * len(self.lr_groups)
        for group, lr in lrs.items():
            values[self._group_index[group]] = float(lr)
        self._pending.append((int(step), values))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        row = int(self.root.attrs["n_lr"])
        steps = np.array([s for s, _ in self._pending], dtype=np.int64)
        values = np.array([v for _, v in self._pending], dtype=np.float64)
        self._write_rows("lr/step", row, steps)
        self._write_rows("lr/value", row, values)
        self.root.attrs["n_lr"] = row + len(self._pending)
        self._pending.clear()

    def truncate_after(self, step: int) -> None:
        """Forget rows of steps > ``step`` (resume from a checkpoint taken at ``step``)."""
        self._pending = [(s, v) for s, v in self._pending if s <= step]
        for kind, key in (("spectra", "n_spectra"), ("lr", "n_lr")):
            n = int(self.root.attrs[key])
            steps = self.root[f"{kind}/step"][:n]
            self.root.attrs[key] = int(np.searchsorted(steps, step, side="right"))

    def _write_row(self, path: str, row: int, value) -> None:
        self._write_rows(path, row, np.asarray(value)[None])

    def _write_rows(self, path: str, row: int, values: np.ndarray) -> None:
        arr = self.root[path]
        end = row + values.shape[0]
        if arr.shape[0] < end:
            arr.resize((end, *arr.shape[1:]))
        arr[row:end] = values


def eigenvalue_setting_fixed(path: str | os.PathLike, stored: bool) -> str:
    """Why ``alrs.log_eigenvalues`` cannot change for the log at ``path`` (``stored``: its
    setting), in the words of both refusals: the log's own and the trainer's resume check."""
    return (f"the ALRS log {path} holds eigenvalues for {'every' if stored else 'no'} analysis, "
            "which cannot change within it")


def stores_eigenvalues(path: str | os.PathLike) -> bool | None:
    """Whether the ALRS log at ``path`` stores eigenvalues (``log_eigenvalues``, fixed for the
    life of a log); None where there is no complete log to append to."""
    if not os.path.exists(os.path.join(os.fspath(path), "zarr.json")):
        return None
    attrs = _open_group(os.fspath(path)).attrs
    return bool(attrs["log_eigenvalues"]) if attrs.get("format") == FORMAT else None


def _open_group(path: str):
    """The zarr group at ``path``, read-only; what cannot be read as one is a one-line
    ConfigError naming ``path`` (a training start's resume checks open it too)."""
    try:
        return require_zarr().open_group(path, mode="r")
    except OSError:  # missing, or no zarr group there (zarr's GroupNotFoundError)
        raise config_error(f"{path}: no ALRS log there (a run with train.use_alrs=true writes "
                           "<out_dir>/alrs.zarr)") from None
    except ValueError as e:  # an array's store, or a zarr.json that is not zarr's JSON
        raise config_error(f"{path}: not a readable ALRS log ({e})") from None


def read_log(path: str | os.PathLike) -> ALRSLogData:
    """Reads the committed rows of an ALRS log (read-only); a path that holds none, or a log
    that cannot be read (an array or chunk missing or damaged), is a ValueError naming it."""
    root = _open_group(os.fspath(path))
    attrs = root.attrs
    if attrs.get("format") != FORMAT:
        raise ValueError(f"{os.fspath(path)} is not an ALRS log (format {attrs.get('format')!r})")
    try:
        return _read_rows(root)
    except (KeyError, ValueError, OSError, RuntimeError) as e:  # RuntimeError: a damaged chunk
        raise ValueError(f"{os.fspath(path)}: not a readable ALRS log ({type(e).__name__}: "
                         f"{e})") from None


def _read_rows(root) -> ALRSLogData:
    attrs = root.attrs
    ns, nl = int(attrs["n_spectra"]), int(attrs["n_lr"])
    matrices = list(attrs["matrices"])
    eigs = {}
    if attrs["log_eigenvalues"]:
        eigs = {m: root[f"eigenvalues/{i}"][:ns] for i, m in enumerate(matrices)}
    return ALRSLogData(
        matrices=matrices, shapes=[tuple(s) for s in attrs["shapes"]], config=dict(attrs["config"]),
        spectra_step=root["spectra/step"][:ns], allocated=root["spectra/allocated"][:ns],
        alpha=root["spectra/alpha"][:ns], multiplier=root["spectra/multiplier"][:ns],
        stable_rank=root["spectra/stable_rank"][:ns],
        norm_stable_rank=root["spectra/norm_stable_rank"][:ns],
        eigenvalues=eigs, lr_groups=list(attrs["lr_groups"]), lr_step=root["lr/step"][:nl],
        lr_value=root["lr/value"][:nl])
