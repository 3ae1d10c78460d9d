"""Parameter counts and analytical forward FLOPs per position for every preset.

    python tools/flops.py                 # tables: Dense / Full Loop / AsymLoop at matched depth,
                                          # and the LatentLoop family (MoE base / Loop / LatentLoop)
    python tools/flops.py --json          # the same as JSON
    python tools/flops.py --measure       # cross-check against torch's FlopCounterMode on CPU:
                                          # forward, backward under each recomputation
    python tools/flops.py --measure --json  # its counts as JSON

The tables use the paper's method (Appendix D: matmul FLOPs, full N x N attention) with each
preset's own sequence length N and vocabulary V (the He et al. sizes have the paper's N = 1024,
V = 32128). At effective depth J = (K + 1) / 2 * L, AsymLoop K is compared with Full Loop R = J / L
and with a Dense model of J physical layers. MoE layers count their active parameters; a LatentLoop
visit compressed k times costs 1/k of a full visit's projections and experts and 1/k^2 of its scores.

--measure builds a small AsymLoop, MoE AsymLoop (with a shared expert) and LatentLoop and counts
the backward with no, full and selective recomputation of each module the model has (core_attn,
mlp, moe, shared_experts, moe+shared_experts; layernorm and moe_act where Transformer Engine is
installed); it exits 1 when a count is off the analytical one by 1% or more.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megaloop.config import ConfigError, ModelConfig
from megaloop.models.flops import (active_parameter_count, executed_backward_flops, forward_flops,
                                   kv_cache_per_token, parameter_count)
from megaloop.presets import ARCH_BOUND, LATENTLOOP_TIERS, PRESETS, preset


def matched_depth_rows(name: str, asym_iterations: int = 3) -> dict:
    """Dense, Full Loop and AsymLoop of preset ``name`` at effective depth J = (K+1)/2 * L."""
    base = preset(name)
    repeats = (asym_iterations + 1) // 2
    models = {
        "dense": preset(name, arch="dense", num_layers=repeats * base.num_layers),
        "fullloop": preset(name, arch="fullloop", iterations=repeats),
        "asymloop": preset(name, arch="asymloop", iterations=asym_iterations),
    }
    row = {"preset": name, "effective_depth": models["asymloop"].effective_depth}
    for arch, cfg in models.items():
        row[f"{arch}_params"] = parameter_count(cfg)
        row[f"{arch}_gflops_per_token"] = forward_flops(cfg).total / 1e9
    row["asymloop_overhead_vs_fullloop_pct"] = 100 * (
        row["asymloop_gflops_per_token"] / row["fullloop_gflops_per_token"] - 1)
    return row


def print_rows(header: str, lines) -> None:
    """A table: ``header``, a rule as wide as it, then ``lines``."""
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)


def print_table(rows: list[dict]) -> None:
    header = (f"{'preset':>6} {'J':>3} | {'params dense':>13} {'full loop':>11} {'asymloop':>11} | "
              f"{'GFLOP/token dense':>17} {'full loop':>9} {'asymloop':>9} | {'asym vs full':>12}")
    print_rows(header, (
        f"{r['preset']:>6} {r['effective_depth']:>3} | {r['dense_params'] / 1e6:>12.1f}M "
        f"{r['fullloop_params'] / 1e6:>10.1f}M {r['asymloop_params'] / 1e6:>10.1f}M | "
        f"{r['dense_gflops_per_token']:>17.3f} {r['fullloop_gflops_per_token']:>9.3f} "
        f"{r['asymloop_gflops_per_token']:>9.3f} | "
        f"{r['asymloop_overhead_vs_fullloop_pct']:>+11.2f}%" for r in rows))


def latentloop_rows(tier: str) -> list[dict]:
    """MoE base, MoE Loop and LatentLoop of a tier: parameters, active parameters, KV cache and
    forward FLOPs per token, and the FLOPs of each visit of the middle block."""
    rows = []
    for family in ("moe-base", "moe-loop", "latentloop"):
        cfg = preset(f"{family}-{tier}")
        full = forward_flops(dataclasses.replace(cfg, latent_visits=[])) \
            if cfg.arch == "latentloop" else None
        fwd = forward_flops(cfg)
        rows.append({
            "preset": f"{family}-{tier}", "params": parameter_count(cfg),
            "active_params": active_parameter_count(cfg),
            "kv_cache_per_token": float(kv_cache_per_token(cfg)),
            "gflops_per_token": float(fwd.total) / 1e9,
            # what compressing visit 1 saves, against the same model with every visit full
            "compression_saving_pct": (100 * float(1 - fwd.total / full.total)
                                       if full is not None else 0.0),
        })
    return rows


def print_latentloop_table(rows: list[dict]) -> None:
    header = (f"{'preset':>16} | {'params':>8} {'active':>8} | {'KV/token':>9} | "
              f"{'GFLOP/token':>11} | {'saved by compressing visit 1':>28}")
    print_rows(header, (
        f"{r['preset']:>16} | {r['params'] / 1e9:>7.3f}B {r['active_params'] / 1e9:>7.3f}B | "
        f"{r['kv_cache_per_token']:>9.0f} | {r['gflops_per_token']:>11.3f} | "
        f"{r['compression_saving_pct']:>27.2f}%" for r in rows))


def print_measured_table(results: list[dict]) -> None:
    header = (f"{'model':>12} {'phase':>8} {'recompute':>24} | {'counted':>11} {'analytical':>11} "
              f"| {'difference':>10}")
    print_rows(header, (
        f"{result['model']:>12} {r['phase']:>8} {recompute_label(r):>24} | "
        f"{r['counted']:>11.4g} {r['analytical']:>11.4g} | {r['rel_diff_pct']:>+9.2f}%"
        for result in results for r in result["measured"]))
    for result in results:
        if result["skipped"]:
            print(f"{result['model']}: not measured: "
                  f"{', '.join('+'.join(s['modules']) for s in result['skipped'])} (not in this "
                  "model, or not on this backend: --json gives each reason)")


# The recomputations --measure counts: none, full, and selective of each module megatron-core
# checkpoints on its own (moe with shared_experts replays the shared expert twice); a model
# without a module, or a backend that cannot replay it (layernorm, moe_act: Transformer Engine
# only), is listed as skipped with the reason.
RECOMPUTATIONS = (("none", ()), ("selective", ("core_attn",)), ("selective", ("mlp",)),
                  ("selective", ("moe",)), ("selective", ("shared_experts",)),
                  ("selective", ("moe", "shared_experts")), ("selective", ("layernorm",)),
                  ("selective", ("moe_act",)), ("full", ()))


def recompute_label(row: dict) -> str:
    """none, full, or the selective modules joined by '+'."""
    return "+".join(row["modules"]) if row["recompute"] == "selective" else row["recompute"]


def measure(cfg: ModelConfig, batch: int = 2) -> dict:
    """Counts FLOPs of forward and backward under each of ``RECOMPUTATIONS`` the model has with
    FlopCounterMode and compares each with the analytical count. Returns ``measured``, one dict
    per (phase, recomputation), and ``skipped``, the recomputations not run and why."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megaloop.config import ParallelConfig
    from megaloop.models.flops import register_cpu_flash_flop_formulas
    from megaloop.models.build_device import built_on_cpu
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    init_distributed()
    register_cpu_flash_flop_formulas()
    tokens = batch * cfg.seq_length
    fwd = forward_flops(cfg).total
    measured, skipped = [], []
    for recompute, modules in RECOMPUTATIONS:
        try:
            with built_on_cpu():  # the count runs on the CPU, on a GPU machine too
                model = build_model(cfg, ParallelConfig(recompute=recompute,
                                                        recompute_modules=list(modules)))
        except ConfigError as e:  # a module this model or backend does not have
            if recompute != "selective":  # the config itself is wrong: not a skip
                raise
            skipped.append(dict(modules=list(modules), reason=str(e)))
            continue
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length))
        with FlopCounterMode(display=False) as counter:
            loss = model(x, labels=x).mean()
        counted_fwd = counter.get_total_flops() / tokens
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        counted_bwd = counter.get_total_flops() / tokens
        expected_bwd = executed_backward_flops(cfg, recompute, modules)
        for phase, counted, analytical in (("forward", counted_fwd, fwd),
                                           ("backward", counted_bwd, expected_bwd)):
            analytical = float(analytical)
            measured.append(dict(phase=phase, recompute=recompute, modules=list(modules),
                                 counted=counted, analytical=analytical,
                                 rel_diff_pct=100 * (counted - analytical) / analytical))
    return dict(measured=measured, skipped=skipped)


MEASURE_TOLERANCE_PCT = 1.0  # --measure fails when a count differs from the analytical by more


def _worst_difference(result: dict) -> float:
    return max(abs(r["rel_diff_pct"]) for r in result["measured"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true",
                        help="print JSON instead of a table (with --measure too)")
    parser.add_argument("--iterations", type=int, default=3, help="AsymLoop K (odd; default 3)")
    parser.add_argument("--measure", action="store_true",
                        help="cross-check against FlopCounterMode on small AsymLoop, MoE AsymLoop "
                        "and LatentLoop configs, under each recomputation")
    args = parser.parse_args(argv)
    try:
        if args.iterations < 1 or args.iterations % 2 == 0:
            raise ConfigError(f"--iterations={args.iterations}: must be odd and >= 1 so that "
                              "J = (K + 1) / 2 * L is a whole number of Full Loop repeats")
        if args.measure:
            small = dict(seq_length=64, vocab_size=512)
            configs = {
                "asymloop": preset("tiny", arch="asymloop", iterations=args.iterations, **small),
                "asymloop_moe": preset("tiny", arch="asymloop", iterations=args.iterations,
                                       num_experts=4, moe_top_k=2, moe_shared_expert_size=64,
                                       **small),
                "latentloop": preset("latentloop-tiny", **small),
            }
            results = [{"model": name, "config": dataclasses.asdict(cfg), **measure(cfg)}
                       for name, cfg in configs.items()]
            if args.json:
                print(json.dumps(results, indent=2))
            else:
                print_measured_table(results)
                print("\nFLOPs per token, counted by FlopCounterMode on CPU (seq_length 64).")
            worst = max(results, key=_worst_difference)
            if _worst_difference(worst) >= MEASURE_TOLERANCE_PCT:
                row = max(worst["measured"], key=lambda r: abs(r["rel_diff_pct"]))
                print(f"error: {worst['model']} {row['phase']} (recompute={recompute_label(row)}): "
                      f"counted {row['counted']:.4g} FLOPs per token, analytical "
                      f"{row['analytical']:.4g} ({row['rel_diff_pct']:+.2f}%, more than "
                      f"{MEASURE_TOLERANCE_PCT:g}%)", file=sys.stderr)
                return 1
            return 0
        rows = [matched_depth_rows(n, args.iterations) for n in PRESETS
                if n != "tiny" and n not in ARCH_BOUND]
        latent = [row for tier in LATENTLOOP_TIERS for row in latentloop_rows(tier)]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"matched_depth": rows, "latentloop": latent}, indent=2))
    else:
        print_table(rows)
        print("\nParameters exclude nothing (embeddings, head and norms included). Analytical "
              "matmul FLOPs,\neach preset's N and V, full NxN attention (paper Appendix D). "
              "The paper reports +9.38% to +15.23%.\n")
        print_latentloop_table(latent)
        print("\nMoE: active = parameters a token's forward uses. Budgets matched by "
              "tools/match_budget.py.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
