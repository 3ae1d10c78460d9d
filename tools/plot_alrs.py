"""Plots of ALRS zarr logs, as in the AsymLoop paper (Appendix B):

- Figure 3 (``fig3_lr.png``): mean LR over steps of encoder vs decoder matrices, for attention,
  Global KV and FFN, and the decoder/encoder ratio.
- Figure 4 (``fig4_stable_rank.png``): mean normalised stable rank of the same groups over steps,
  ALRS (solid) against a uniform-LR run (dashed) when one is given.

Matrices are grouped by their megatron-core name (ALRS block names such as
``decoder.layers.1.self_attention.linear_qkv.weight:k``). "attention" is the mean over the local
attention matrices Q, K, V and O, as in the paper; the decoder's Global K and V
(``linear_kv_global``), which the paper's LLaMA does not have, are their own group; "ffn" is gate,
up and down. Embedding and output head are in no figure. Dense and Full Loop name every layer
``decoder``: their plots have no encoder curves. LatentLoop's prelude is ``encoder``, its middle
block ``decoder`` (the copies a visit with untied weights has, ``visits.visit<v>.block``,
included) and its coda a third curve, ``coda``.

    python tools/plot_alrs.py --alrs runs/a/alrs.zarr [--uniform runs/u/alrs.zarr] --out plots/

A path without an ALRS log, a log without rows yet or without encoder/decoder layer matrices
(one of the ALRS API on another model), a log of the other mode (the two paths swapped), a
``--uniform`` log of other matrices than the ``--alrs`` one's (another model, granularity or
exclude) and an ``--out`` that cannot be written are one-line errors on stderr (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from megaloop.alrs import ALRSLogData, read_log  # noqa: E402
from megaloop.cli import unwritable  # noqa: E402
from megaloop.training.plots import save_figure  # noqa: E402

SECTIONS = ("encoder", "decoder", "coda")
SECTION_COLORS = ("C0", "C1", "C2")  # the same in every panel (Global KV has a decoder curve only)
MODULES = ("attention", "global_kv", "ffn")


def classify(name: str) -> tuple[str, str] | None:
    """(section, module) of a layer matrix name, or None for embedding, head and anything else."""
    section = name.split(".", 1)[0]
    if section == "visits" and ".block." in name:  # LatentLoop's untied middle-block copies
        section = "decoder"
    if section not in SECTIONS:
        return None
    if ".self_attention.linear_kv_global." in name:
        return section, "global_kv"
    if ".self_attention." in name:
        return section, "attention"
    if ".mlp." in name:
        return section, "ffn"
    return None


def _columns(names: list[str], section: str, module: str) -> list[int]:
    return [i for i, n in enumerate(names) if classify(n) == (section, module)]


def group_means(values: np.ndarray, names: list[str]) -> dict[tuple[str, str], np.ndarray]:
    """Mean over the matrices of each (section, module) present, per row of ``values``."""
    out = {}
    for section in SECTIONS:
        for module in MODULES:
            cols = _columns(names, section, module)
            if cols:
                out[section, module] = np.nanmean(values[:, cols], axis=1)
    return out


def _present(means: dict) -> list[str]:
    """The modules with at least one curve (no Global KV panel for Dense, Full Loop)."""
    return [m for m in MODULES if any((s, m) in means for s in SECTIONS)]


def plot_lr(log: ALRSLogData, path: str) -> None:
    means = group_means(log.lr_value, log.lr_groups)
    modules = _present(means)
    fig, axes = plt.subplots(1, len(modules) + 1, figsize=(5 * (len(modules) + 1), 4),
                             squeeze=False)
    axes = axes[0]
    for ax, module in zip(axes, modules):
        for color, section in zip(SECTION_COLORS, SECTIONS):
            if (section, module) in means:
                ax.plot(log.lr_step, means[section, module], color=color, label=section)
        ax.set(title=f"mean LR, {module}", xlabel="step", ylabel="learning rate")
        ax.legend()
    ratio_ax = axes[-1]
    for module in MODULES:
        if ("encoder", module) in means and ("decoder", module) in means:
            with np.errstate(divide="ignore", invalid="ignore"):  # LR 0 at the first warmup step
                ratio = means["decoder", module] / means["encoder", module]
            ratio_ax.plot(log.lr_step, ratio, label=module)
    ratio_ax.set(title="decoder / encoder mean LR", xlabel="step", ylabel="ratio")
    if ratio_ax.lines:
        ratio_ax.legend()
    else:
        ratio_ax.text(0.5, 0.5, "no encoder in this model", ha="center", transform=ratio_ax.transAxes)
    save_figure(fig, path)


def plot_stable_rank(runs: dict[str, ALRSLogData], path: str) -> None:
    """``runs``: the --alrs log as "ALRS" (labelled by its mode: --alrs takes a decoder_boost
    run's too) and the --uniform log as "uniform"."""
    styles = {"ALRS": "-", "uniform": "--"}
    labels = {run: "decoder boost" if log.config.get("mode") == "decoder_boost" else run
              for run, log in runs.items()}
    means_of = {run: group_means(log.norm_stable_rank, log.matrices) for run, log in runs.items()}
    modules = _present(means_of["ALRS"])
    fig, axes = plt.subplots(1, len(modules), figsize=(5.5 * len(modules), 4), squeeze=False)
    for ax, module in zip(axes[0], modules):
        for run, log in runs.items():
            means = means_of[run]
            for color, section in zip(SECTION_COLORS, SECTIONS):
                if (section, module) in means:
                    ax.plot(log.spectra_step, means[section, module], styles[run], color=color,
                            label=f"{section}, {labels[run]}")
        ax.set(title=f"normalised stable rank, {module}", xlabel="step",
               ylabel="stable rank / min(m, n)")
        ax.legend()
    save_figure(fig, path)


def _read(path: str, need_lrs: bool, flag: str) -> ALRSLogData:
    """The log at ``path``, refused in one line when it holds no rows to draw or no matrix of a
    figure's groups, or when its run's alrs.mode contradicts the curve ``flag`` labels it
    (--alrs: not uniform; --uniform: uniform), as when the two paths are swapped."""
    log = read_log(path)
    if not any(classify(name) for name in log.matrices):  # figures without a curve
        raise ValueError(f"{flag} {path}: none of its {len(log.matrices)} matrices (e.g. "
                         f"{log.matrices[0] if log.matrices else '-'!r}) is an attention or FFN "
                         "matrix of megatron-core's encoder or decoder layers, which the figures "
                         "draw")
    mode = log.config.get("mode")
    if mode is not None and (mode == "uniform") != (flag == "--uniform"):
        raise ValueError(f"{flag} {path}: the log of an alrs.mode={mode!r} run; "
                         + ("give it as --uniform" if mode == "uniform" else
                            "--uniform takes the log of an alrs.mode='uniform' run"))
    if not len(log.spectra_step) or (need_lrs and not len(log.lr_step)):
        raise ValueError(f"{path}: no {'spectra' if not len(log.spectra_step) else 'LR'} rows "
                         "committed yet (LR rows are written every 100 steps and at the end of "
                         "a run)")
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Figures 3 and 4 of the paper from ALRS logs",
                                     allow_abbrev=False)
    parser.add_argument("--alrs", required=True, help="zarr log of the ALRS run")
    parser.add_argument("--uniform", help="zarr log of the uniform-LR run, for Figure 4")
    parser.add_argument("--out", default=".", help="directory for the PNG files")
    args = parser.parse_args(argv)
    written = [os.path.join(args.out, "fig3_lr.png"), os.path.join(args.out, "fig4_stable_rank.png")]
    try:
        problem = unwritable(written[0])
        if problem is not None:
            raise ValueError(f"--out {args.out}: cannot be written ({problem})")
        runs = {"ALRS": _read(args.alrs, need_lrs=True, flag="--alrs")}
        if args.uniform:
            runs["uniform"] = _read(args.uniform, need_lrs=False, flag="--uniform")
            other = set(runs["uniform"].matrices) ^ set(runs["ALRS"].matrices)
            if other:  # e.g. the uniform run of another architecture: curves of two models
                raise ValueError(f"--uniform {args.uniform}: its matrices differ from those of "
                                 f"--alrs {args.alrs} (e.g. {sorted(other)[0]!r}): Figure 4 "
                                 "compares one model under ALRS and under uniform LRs")
        os.makedirs(args.out, exist_ok=True)
        plot_lr(runs["ALRS"], written[0])
        plot_stable_rank(runs, written[1])
    except ValueError as error:  # megaloop's ConfigError (no zarr) included
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: --out {args.out}: cannot be written ({error.strerror or error})",
              file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
