"""Budget-matched widths for LatentLoop and its baselines (the LatentLoop paper's comparison).

    python tools/match_budget.py                     # every tier: MoE base / MoE Loop / LatentLoop
    python tools/match_budget.py --tier 3B --json
    python tools/match_budget.py --tier 3B --reduction width   # LatentLoop's visit 1 at d/2

The MoE Loop preset of a tier is the reference. For a target structure (LatentLoop: the same
prelude / middle x 2 visits / coda with visit 1 reduced by --reduction, by default the sequence
compression; MoE base: as many unique layers as the
loop has layer applications), the tool searches hidden size d (multiples of --width-step), head dim
d_h (even) and expert count E so that parameters, KV cache per token and training FLOPs per token
all lie within --tolerance of the reference's. With the same batch and steps, FLOPs per step and
total FLOPs differ exactly as FLOPs per token do; the table prints all four. KV cache depends on d_h
alone, FLOPs mostly on d, parameters on E: d_h is fitted first, then (d, E) jointly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from megaloop.cli import float_above, int_at_least
from megaloop.config import ConfigError, ModelConfig
from megaloop.config.model import LatentReduction
from megaloop.models.flops import budget
from megaloop.presets import LATENTLOOP_TIERS, preset

BUDGET_KEYS = ("parameters", "kv_cache_per_token", "train_flops_per_token")


def relative_errors(cfg: ModelConfig, reference: dict) -> dict[str, float]:
    got = budget(cfg)
    return {key: got[key] / reference[key] - 1 for key in BUDGET_KEYS}


def target_structure(reference: ModelConfig, target: str,
                     reduction: LatentReduction = "sequence") -> ModelConfig:
    """The reference's layer structure as ``target``: "latentloop" (visit 1 reduced by
    ``reduction``, learned residual scales) or "moe_base" (no loop: one unique layer per layer
    application)."""
    if target == "latentloop":
        return dataclasses.replace(reference, latent_visits=[1], residual_scale="learned",
                                   latent_reduction=reduction)
    if target == "moe_base":
        return ModelConfig(**{
            **{f.name: getattr(reference, f.name) for f in dataclasses.fields(ModelConfig)
               if f.name in ("hidden_size", "ffn_hidden_size", "num_attention_heads",
                             "num_query_groups", "head_dim", "vocab_size", "seq_length",
                             "num_experts", "moe_top_k", "moe_ffn_hidden_size",
                             "moe_shared_expert_size")},
            "arch": "dense", "iterations": 1, "num_layers": reference.effective_depth})
    raise ConfigError(f"--target={target!r}: must be latentloop or moe_base")


def match(reference: ModelConfig, template: ModelConfig, width_step: int = 16,
          tolerance: float = 0.01) -> tuple[ModelConfig, dict[str, float]]:
    """The (d, d_h, E) of ``template`` whose budget is closest to ``reference``'s (largest of the
    three relative errors); raises ConfigError if that is above ``tolerance``."""
    target = budget(reference)
    head = reference.resolve().kv_channels
    head_dims = range(max(2, head // 2 // 2 * 2), 2 * head + 1, 2)
    kv_error = {h: abs(relative_errors(dataclasses.replace(template, head_dim=h), target)
                       ["kv_cache_per_token"]) for h in head_dims}
    head_dim = min(kv_error, key=kv_error.get)
    best, best_error = None, float("inf")
    d0 = reference.hidden_size
    lowest = -(-(d0 * 3 // 4) // width_step) * width_step  # the first multiple >= 3/4 d0
    widths = range(lowest, d0 * 3 // 2 + 1, width_step)
    if not widths:  # was a search of d = 0 alone, "closest: 100.00%"
        raise ConfigError(f"--width-step {width_step}: no hidden size from {d0 * 3 // 4} to "
                          f"{d0 * 3 // 2} (3/4 to 3/2 of the reference's) is a multiple of it")
    for d in widths:
        for experts in range(reference.moe_top_k, 3 * reference.num_experts + 1):
            cfg = dataclasses.replace(template, hidden_size=d, head_dim=head_dim,
                                      num_experts=experts)
            error = max(abs(e) for e in relative_errors(cfg, target).values())
            if error < best_error:
                best, best_error = cfg, error
    if best_error > tolerance:
        raise ConfigError(f"no width within {tolerance:.2g} (relative) of the reference budget "
                          f"(closest: {best_error:.2%}); try a finer --width-step or a larger "
                          "--tolerance")
    best.validate()
    return best, relative_errors(best, target)


def table_rows(models: dict[str, ModelConfig], tokens_per_step: int, steps: int) -> list[dict]:
    reference = budget(models["moe_loop"])
    rows = []
    for name, cfg in models.items():
        got = budget(cfg)
        cfg = cfg.resolve()
        flops_step = got["train_flops_per_token"] * tokens_per_step
        rows.append({
            "model": name, "arch": cfg.arch, "layers": cfg.num_layers,
            "effective_depth": cfg.effective_depth, "hidden_size": cfg.hidden_size,
            "head_dim": cfg.kv_channels, "experts": cfg.num_experts, **got,
            "flops_per_step": flops_step, "total_flops": flops_step * steps,
            **{f"{key}_vs_moe_loop_pct": 100 * (got[key] / reference[key] - 1)
               for key in BUDGET_KEYS},
        })
    return rows


def print_table(tier: str, reduction: str, rows: list[dict]) -> None:
    print(f"tier {tier}, LatentLoop's first visit reduced by {reduction}")
    header = (f"{'model':>11} {'L':>3} {'J':>3} {'d':>5} {'d_h':>4} {'E':>4} | {'params':>8} "
              f"{'active':>8} {'KV/token':>9} {'TFLOP/step':>11} {'total EFLOP':>11} | "
              f"{'params':>7} {'KV':>7} {'FLOPs':>7}  (vs MoE Loop)")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:>11} {r['layers']:>3} {r['effective_depth']:>3} {r['hidden_size']:>5} "
              f"{r['head_dim']:>4} {r['experts']:>4} | {r['parameters'] / 1e9:>7.3f}B "
              f"{r['active_parameters'] / 1e9:>7.3f}B {r['kv_cache_per_token']:>9.0f} "
              f"{r['flops_per_step'] / 1e12:>11.1f} {r['total_flops'] / 1e18:>11.1f} | "
              + " ".join(f"{r[f'{k}_vs_moe_loop_pct']:>+6.2f}%" for k in BUDGET_KEYS))
    print()


def tier_list(value: str) -> list[str]:
    """``--tier 1.3B,3B``: each a tier of LATENTLOOP_TIERS, or an argparse error naming it."""
    tiers = value.split(",")
    unknown = next((tier for tier in tiers if tier not in LATENTLOOP_TIERS), None)
    if unknown is not None:
        raise argparse.ArgumentTypeError(f"{unknown!r}: not a tier (choose from {', '.join(LATENTLOOP_TIERS)})")
    return tiers


def matched(reference: ModelConfig, tier: str, target: str, args) -> ModelConfig:
    """``match`` of ``target``'s structure to tier ``tier``'s reference; its ConfigError names
    the tier and the target (of the six matches a run makes, which one found no width)."""
    try:
        return match(reference, target_structure(reference, target, args.reduction),
                     args.width_step, args.tolerance)[0]
    except ConfigError as e:
        raise ConfigError(f"tier {tier}, {target}: {e}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", type=tier_list, action="extend", metavar="TIER[,TIER...]",
                        help=f"tiers to match, comma-separated or flag by flag ({', '.join(LATENTLOOP_TIERS)}; "
                             "default: all)")
    parser.add_argument("--reduction", choices=typing.get_args(LatentReduction),
                        default="sequence", help="how LatentLoop's first visit is reduced "
                                                 "(model.latent_reduction; default: %(default)s)")
    parser.add_argument("--width-step", type=int_at_least(1), default=16,
                        help="hidden size granularity")
    parser.add_argument("--tolerance", type=float_above(0), default=0.01)
    parser.add_argument("--tokens-per-step", type=int_at_least(1), default=1024 * 2048)
    parser.add_argument("--steps", type=int_at_least(1), default=20_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = []
    try:
        for tier in dict.fromkeys(args.tier or LATENTLOOP_TIERS):  # each once, however often given
            reference = preset(f"moe-loop-{tier}")
            models = {"moe_base": matched(reference, tier, "moe_base", args),
                      "moe_loop": reference,
                      "latentloop": matched(reference, tier, "latentloop", args)}
            rows = table_rows(models, args.tokens_per_step, args.steps)
            out.append({"tier": tier, "reduction": args.reduction, "rows": rows})
            if not args.json:
                print_table(tier, args.reduction, rows)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
