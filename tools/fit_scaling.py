"""Compute scaling fits: validation NLL against training compute, per architecture.

    python tools/fit_scaling.py runs/moe_base_* runs/latentloop_* --target 1.988 \\
        --baseline moe_base --plot scaling.png
    python tools/fit_scaling.py base=runs/a base=runs/b latent=runs/c ... --json

Each RUN is a training output directory (``config.yaml`` and ``metrics.jsonl``), optionally prefixed
``LABEL=`` (an argument that is a directory is all path, so ``runs/lr=3e-4`` works); without a
label the architecture names it (dense/fullloop/asymloop, "_moe" with experts;
LatentLoop without compressed visits is "moe_loop"). A run contributes the validation loss of its
highest evaluated step (``--all-evals``: of every evaluated step; a step logged again, the last
record) at the compute spent until then:
    C = training FLOPs per token (3 x forward, megaloop.models.flops, of the run's config.yaml)
        x the tokens trained on up to that evaluation.
A run whose train records show another model than config.yaml's (one changed across resumes, such
as the depth or the sequence length: config.yaml holds only the last start's) is refused.
The tokens are summed step by step from metrics.jsonl's train records (tokens_per_s x step_time_s:
each step's own global batch x sequence length, so a resume that changed the batch size is counted
right); a step without such a record (a metrics file cut short, a run continued from another run
directory) counts config.yaml's global batch x sequence length, and a note on stderr says how many.
Per label the tool fits L(C) = E + A * C^(-alpha) (E: irreducible loss; for each E on a grid the
power law is a straight line in log-log space, so the fit is a least-squares line plus a 1-D search),
reports the compute each label needs to reach ``--target`` and its saving against ``--baseline``
(the LatentLoop paper: 19.0% less than MoE base at NLL 1.988), and plots points and fits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megaloop.cli import float_above, unwritable
from megaloop.config import ConfigError, RunConfig, load_yaml
from megaloop.models.flops import model_flops_per_token
from megaloop.training.plots import save_figure
from megaloop.training.monitor import read_metrics

MIN_POINTS = 3  # three parameters


class Fit(NamedTuple):
    irreducible: float  # E
    scale: float  # A
    exponent: float  # alpha
    rms_residual: float

    def loss(self, compute):
        return self.irreducible + self.scale * np.asarray(compute, dtype=float) ** -self.exponent

    def compute_for(self, loss: float) -> float:
        """Compute at which the fit reaches ``loss``; inf if it never does."""
        if loss <= self.irreducible:
            return math.inf
        return (self.scale / (loss - self.irreducible)) ** (1 / self.exponent)


def label_of(cfg: RunConfig) -> str:
    model = cfg.model
    if model.arch == "latentloop":
        if not model.latent_visits:
            return "moe_loop"
        # The paper's other first-visit reductions are ablations, not the MoE Loop baseline.
        reduction = model.latent_reduction
        return "latentloop" if reduction == "sequence" else f"latentloop_{reduction}"
    if model.arch == "dense" and model.num_experts:
        return "moe_base"
    return model.arch + ("_moe" if model.num_experts else "")


def logged_tokens(metrics: Path, records: list[dict]) -> dict[int, int]:
    """Tokens of each step that a train record logs (tokens_per_s x step_time_s); a step logged
    twice (lines a resume did not drop) counts its last record. A count below one token (the
    trainer logs none: a corrupt or hand-made record) is a ConfigError naming the step, not a
    compute of zero or below that would make the fit NaN."""
    tokens = {}
    for r in records:
        rate, seconds = r.get("tokens_per_s"), r.get("step_time_s")
        if r.get("kind") == "train" and isinstance(rate, (int, float)) \
                and isinstance(seconds, (int, float)) and math.isfinite(rate * seconds):
            if round(rate * seconds) < 1:
                raise ConfigError(f"{metrics}: step {r['step']} logs tokens_per_s={rate} x "
                                  f"step_time_s={seconds}, not a positive number of tokens")
            tokens[r["step"]] = round(rate * seconds)
    return tokens


def check_one_model(metrics: Path, records: list[dict], flops_per_token: float) -> None:
    """Refuses (ConfigError) a run whose train records were logged by another model than
    config.yaml's, which holds only the last start's: a resume may change model.iterations or
    model.seq_length, and their steps would be counted at the wrong FLOPs per token. A record
    logs tflops_per_device = tokens_per_s x FLOPs per token / world size; the world size is not
    logged and may change on a resume too, so a step is taken for config.yaml's model's when that
    model's FLOPs per token give it a whole number of processes (a model change whose FLOPs ratio
    happens to make one passes)."""
    for r in records:
        rate, tflops = r.get("tokens_per_s"), r.get("tflops_per_device")
        if r.get("kind") != "train" or not all(isinstance(v, (int, float)) and v > 0
                                               for v in (rate, tflops)):
            continue
        processes = flops_per_token * rate / (tflops * 1e12)
        if round(processes) < 1 or abs(processes - round(processes)) > 1e-6 * processes:
            raise ConfigError(
                f"{metrics}: step {r['step']} was trained at {tflops * 1e12 / rate:.6g} FLOPs per "
                f"token per process, which config.yaml's model ({flops_per_token:.6g} per token) "
                "gives on no whole number of processes: the model changed across resumes (e.g. "
                "model.iterations or model.seq_length) and config.yaml holds the last one only; "
                "leave the run out")


def tokens_until(steps: list[int], logged: dict[int, int], unlogged_step_tokens: int
                 ) -> tuple[dict[int, int], int]:
    """({step: tokens trained on in steps 1..step} for ``steps``, how many of the steps up to the
    last have no logged count and were counted at ``unlogged_step_tokens``)."""
    total, unlogged, done, until = 0, 0, 0, {}
    for step in sorted(set(steps)):
        for s in range(done + 1, step + 1):
            total += logged.get(s, unlogged_step_tokens)
            unlogged += s not in logged
        done, until[step] = step, total
    return until, unlogged


def run_points(path: Path, all_evals: bool) -> tuple[str, list[tuple[float, float]], str | None]:
    """(label from the config, [(compute, validation loss)], a note on steps whose tokens no
    train record logs, or None) of one run directory."""
    config, metrics = path / "config.yaml", path / "metrics.jsonl"
    for needed in (config, metrics):
        if not needed.is_file():
            raise ConfigError(f"{path}: no {needed.name} (not a megaloop run directory)")
    cfg = load_yaml(config)
    records, _ = read_metrics(metrics)
    # One point per evaluated step, its last record: a metrics.jsonl written before the trainer
    # stopped repeating the final step's evaluation (train_steps a multiple of eval_interval) has
    # two records of that step. In step order, not the file's: the trainer keeps metrics.jsonl
    # in step order (a resume drops the lines from its step on), but a file joined from several
    # (by hand, or by a tool copying runs together) need not be, and "the last evaluation" is
    # the highest step's.
    latest = {r["step"]: r for r in records if r.get("kind") == "eval" and "val_loss" in r}
    if not latest:
        raise ConfigError(f"{metrics}: no evaluation with a val_loss")
    evals = [latest[step] for step in sorted(latest)]
    evals = evals if all_evals else evals[-1:]
    for r in evals:  # a NaN point would make the whole label's fit NaN, as would one <= 0
        if r["step"] < 1:  # log(C = 0) in the fit: a LinAlgError traceback
            raise ConfigError(f"{metrics}: an evaluation at step {r['step']}, before any training"
                              " (C = 0 FLOPs, which a power law in C cannot take); leave it out")
        loss = r["val_loss"]
        # The trainer logs a NaN/Inf loss as null: skipping it would take an earlier evaluation
        # of the diverged run as its point.
        if loss is None or isinstance(loss, float) and not math.isfinite(loss):
            raise ConfigError(f"{metrics}: val_loss={'null (NaN/Inf)' if loss is None else loss}"
                              f" at step {r['step']} (a diverged run: leave it out)")
        if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not loss > 0:
            raise ConfigError(f"{metrics}: val_loss={loss!r} at step {r['step']}: a validation "
                              "NLL is a number > 0")
    step_tokens = cfg.train.global_batch_size * cfg.model.seq_length
    until, unlogged = tokens_until([r["step"] for r in evals], logged_tokens(metrics, records),
                                step_tokens)
    note = None
    if unlogged:
        note = (f"{metrics}: {unlogged} of the {max(until)} steps have no train record with "
                f"tokens_per_s and step_time_s; counted at config.yaml's global_batch_size x "
                f"seq_length = {step_tokens} tokens each")
    flops = model_flops_per_token(cfg.model)
    check_one_model(metrics, records, flops)
    return label_of(cfg), [(flops * until[r["step"]], float(r["val_loss"])) for r in evals], note


def fit_power_law(points: list[tuple[float, float]], grid: int = 400) -> Fit:
    compute = np.array([c for c, _ in points], dtype=float)
    loss = np.array([nll for _, nll in points], dtype=float)
    if len(points) < MIN_POINTS or len(set(compute)) < MIN_POINTS:
        raise ConfigError(f"{len(set(compute))} distinct compute values: a fit of E + A C^-alpha "
                          f"needs at least {MIN_POINTS}")
    if loss.min() == loss.max():  # would fit exponent 0: a "power law" that never falls
        raise ConfigError(f"validation loss {loss[0]:g} at every compute: no power law to fit")
    log_c = np.log(compute)

    def line_fit(irreducible: float) -> Fit | None:
        """The power law of this E (a least-squares line in log-log space), None if not falling."""
        slope, intercept = np.polyfit(log_c, np.log(loss - irreducible), 1)
        if slope >= 0:
            return None
        fit = Fit(float(irreducible), float(np.exp(intercept)), float(-slope), 0.0)
        return fit._replace(rms_residual=float(np.sqrt(np.mean((fit.loss(compute) - loss) ** 2))))

    best, low, high = None, 0.0, float(loss.min())
    # A grid over [0, min loss), then finer grids around the best point: the first grid's spacing
    # (min loss / grid) alone put E off by up to half of it, and a compute extrapolated below the
    # runs' losses by several percent.
    for _ in range(4):
        grid_best = min((fit for fit in map(line_fit, np.linspace(low, high, grid,
                                                                    endpoint=False))
                         if fit is not None), key=lambda fit: fit.rms_residual, default=None)
        if grid_best is None:
            break
        best = grid_best if best is None or grid_best.rms_residual <= best.rms_residual else best
        step = (high - low) / grid
        low, high = max(0.0, best.irreducible - step), min(high, best.irreducible + step)
    if best is None:
        raise ConfigError("validation loss does not fall with compute: no power law to fit")
    return best


def label_and_directory(run: str) -> tuple[str, str]:
    """(label, or "" to take the architecture's; run directory) of a ``[LABEL=]RUN_DIR``
    argument. A sweep's directory may hold "=" (runs/lr=3e-4): an argument that is a directory is
    all path, and a label is split off only when the argument holds "=". A ConfigError names the
    argument when no directory is found: an empty path would read the current directory's run."""
    split = "=" in run and not Path(run).is_dir()
    label, _, path = run.partition("=") if split else ("", "", run)
    if path and Path(path).is_dir():
        return label, path
    if path == run:
        problem = "not a directory" if Path(run).exists() else "does not exist"
        raise ConfigError(f"{run}: {problem}")
    raise ConfigError(f"{run}: not a directory, nor is {path!r} after the label {label!r}")


def analyse(runs: list[str], target: float | None, baseline: str | None,
            all_evals: bool) -> dict:
    points: dict[str, list[tuple[float, float]]] = {}
    notes, seen = [], set()
    for run in runs:
        label, path = label_and_directory(run)
        if Path(path).resolve() in seen:  # a glob overlapping another: its points twice
            raise ConfigError(f"{path}: given twice")
        seen.add(Path(path).resolve())
        found, run_pts, note = run_points(Path(path), all_evals)
        points.setdefault(label or found, []).extend(run_pts)
        notes += [note] if note else []
    if baseline is not None and baseline not in points:
        raise ConfigError(f"--baseline={baseline!r}: no such label (labels: "
                          f"{', '.join(sorted(points))})")
    fits = {}
    for label, pts in points.items():
        try:
            fits[label] = fit_power_law(pts)
        except ConfigError as e:
            raise ConfigError(f"label {label!r}: {e}") from None
    out = {"fits": {}, "points": {k: sorted(v) for k, v in points.items()}, "notes": notes}
    for label, fit in fits.items():
        entry = {"irreducible": fit.irreducible, "scale": fit.scale, "exponent": fit.exponent,
                 "rms_residual": fit.rms_residual}
        if target is not None:
            needed = fit.compute_for(target)
            entry["compute_for_target"] = needed if math.isfinite(needed) else None
            if baseline is not None:
                reference = fits[baseline].compute_for(target)
                entry["saving_vs_baseline_pct"] = (100 * (1 - needed / reference)
                                                   if math.isfinite(needed * reference) else None)
        out["fits"][label] = entry
    return out


def plot(result: dict, path: str, target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in result["points"].items():
        compute = np.array([c for c, _ in pts])
        line, = ax.plot(compute, [nll for _, nll in pts], "o", label=label)
        fit = Fit(**{k: result["fits"][label][k] for k in ("irreducible", "scale", "exponent",
                                                          "rms_residual")})
        grid = np.geomspace(compute.min() / 2, compute.max() * 2, 100)
        ax.plot(grid, fit.loss(grid), "-", color=line.get_color())
    if target is not None:
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target}")
    ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("validation NLL")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="[LABEL=]RUN_DIR")
    parser.add_argument("--target", type=float_above(0), help="NLL at which to compare compute")
    parser.add_argument("--baseline", help="label the savings are measured against")
    parser.add_argument("--all-evals", action="store_true",
                        help="every evaluation of a run is a point (default: its last)")
    parser.add_argument("--plot", help="write the points and fits to this image")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.baseline is not None and args.target is None:
            raise ConfigError("--baseline needs --target (the NLL at which compute is compared)")
        problem = unwritable(args.plot) if args.plot else None
        if problem is not None:
            raise ConfigError(f"--plot {args.plot}: cannot be written ({problem})")
        result = analyse(args.runs, args.target, args.baseline, args.all_evals)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    if args.plot:
        try:
            plot(result, args.plot, args.target)
        except (OSError, ValueError) as e:  # ValueError: an image format matplotlib lacks
            print(f"error: --plot {args.plot}: cannot be written "
                  f"({getattr(e, 'strerror', None) or e})", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result["fits"], indent=2))
        return 0
    for label, fit in result["fits"].items():
        line = (f"{label:>12}: L(C) = {fit['irreducible']:.4f} + {fit['scale']:.4g} * "
                f"C^-{fit['exponent']:.4f}  (rms {fit['rms_residual']:.2g})")
        if args.target is not None:
            needed = fit["compute_for_target"]
            line += f" | C({args.target}) = " + (f"{needed:.3e}" if needed else "unreachable")
            saving = fit.get("saving_vs_baseline_pct")
            if args.baseline is not None:  # n/a: one of the two never reaches the target
                line += f" | saving vs {args.baseline}: " + (f"{saving:+.1f}%" if saving is not
                                                             None else "n/a")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
