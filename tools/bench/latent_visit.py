"""Forward+backward time of LatentLoop's reduced first visit against a full visit of the same
middle block, in one run, beside the analytical FLOP saving. Prints JSON.

    python tools/bench/latent_visit.py [--hidden 256 --seq 2048 --experts 8 --top-k 2 --repeats 15]
    python tools/bench/latent_visit.py --reductions sequence,top_k,width,expert_ffn --top-k 4

Per reduction (``latent_reduction``; default: the sequence compression), one LatentLoop model whose
visit 1 is reduced and visit 2 is full, both over the one shared middle block (MoE FFNs): sequence
pools k = --stride tokens per latent, runs the block on N/k latents and writes back; top_k routes to
half the experts; width runs the block at d/2 between projections; expert_ffn uses half of each
expert's hidden units. Every reduced visit and the full visit (of the first model) are timed
alternately on the same input so that machine noise hits all of them.
Goal (issue 8): the compressed visit saves at least 40% of the full visit's time (ideal 1 - 1/k of
the projections and experts, more of the attention scores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from megaloop.cli import int_at_least, parsed_preset
from megaloop.models.flops import forward_flops


def visit_flops(cfg, visit: int) -> float:
    """Forward FLOPs per token of one visit: the model minus the same model without it."""
    others = [v for v in cfg.latent_visits if v != visit]
    whole = forward_flops(cfg).total
    fewer = forward_flops(dataclasses.replace(cfg, iterations=cfg.iterations - 1,
                                              latent_visits=[v - (v > visit) for v in others],
                                              residual_scale_init=[])).total
    return float(whole - fewer)


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_at_least(1), default=256)
    parser.add_argument("--heads", type=int_at_least(1), default=4)
    parser.add_argument("--middle-layers", type=int_at_least(1), default=2)
    parser.add_argument("--experts", type=int_at_least(1), default=8)
    parser.add_argument("--top-k", type=int_at_least(1), default=2)
    parser.add_argument("--expert-ffn", type=int_at_least(1), default=256)
    parser.add_argument("--seq", type=int_at_least(1), default=2048)
    parser.add_argument("--stride", type=int_at_least(1),
                        help="tokens pooled per latent by the sequence reduction (default 2)")
    parser.add_argument("--batch", type=int_at_least(1), default=1)
    parser.add_argument("--repeats", type=int_at_least(1), default=15)
    parser.add_argument("--reductions", default="sequence",
                        help="comma-separated latent_reduction values, each timed against the "
                        "full visit")
    args = parser.parse_args(argv)
    reductions = args.reductions.split(",")
    if args.stride is not None and "sequence" not in reductions:
        parser.error(f"--stride {args.stride}: only the sequence reduction reads it; --reductions "
                     f"{args.reductions} times none")
    stride = args.stride or 2

    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    init_distributed()
    configs = {reduction: parsed_preset(
        parser, "latentloop-tiny", hidden_size=args.hidden, num_attention_heads=args.heads,
        num_layers=args.middle_layers + 2, num_experts=args.experts, moe_top_k=args.top_k,
        moe_ffn_hidden_size=args.expert_ffn, seq_length=args.seq, latent_reduction=reduction,
        **({"latent_stride": stride} if reduction == "sequence" else {}))
        for reduction in reductions}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    models = {reduction: build_model(cfg, params_dtype=dtype).to(device)
              for reduction, cfg in configs.items()}
    visits = {reduction: model.visits.visit1 for reduction, model in models.items()}
    visits["full"] = models[reductions[0]].visits.visit2
    rope = models[reductions[0]].rotary_pos_emb(args.seq)
    hidden = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=dtype)

    def step(visit):
        x = hidden.detach().requires_grad_()
        for model in models.values():
            model.zero_grad(set_to_none=True)
        visit(x, rope).float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    times = {name: [] for name in visits}
    for visit in visits.values():
        step(visit)  # warm-up
    for _ in range(args.repeats):
        for name, visit in visits.items():
            start = time.perf_counter()
            step(visit)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    # On a shared machine other jobs only ever add time: the fastest repeat is the least disturbed.
    fastest = {name: min(t) for name, t in times.items()}
    full_flops = visit_flops(configs[reductions[0]], 2)
    print(json.dumps({
        "config": {"hidden": args.hidden, "middle_layers": args.middle_layers,
                   "experts": args.experts, "top_k": args.top_k, "expert_ffn": args.expert_ffn,
                   "seq": args.seq, "stride": stride if "sequence" in reductions else None,
                   "batch": args.batch,
                   "device": device, "dtype": str(dtype), "threads": torch.get_num_threads()},
        "median_s": median, "min_s": fastest,
        "time_saving_pct": {reduction: {
            "median": 100 * (1 - median[reduction] / median["full"]),
            "min": 100 * (1 - fastest[reduction] / fastest["full"])} for reduction in reductions},
        "analytical_flop_saving_pct": {
            reduction: 100 * (1 - visit_flops(configs[reduction], 1) / full_flops)
            for reduction in reductions},
        "goal_saving_pct": {"sequence": 40.0},
        "all_s": times,
    }, indent=2))


if __name__ == "__main__":
    main()
