"""Forward+backward time of LatentLoop's compressed visit against a full visit of the same middle
block, in one run, beside the analytical FLOP saving. Prints JSON.

    python tools/bench/latent_visit.py [--hidden 256 --seq 2048 --experts 8 --top-k 2 --repeats 15]

Both visits are the modules of one LatentLoop model sharing one middle block (MoE FFNs): visit 1
pools k = --stride tokens per latent, runs the block on N/k latents and writes back; visit 2 runs it
on all N positions. They are timed alternately on the same input so that machine noise hits both.
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

from megaloop.models.flops import forward_flops
from megaloop.presets import preset


def visit_flops(cfg, visit: int) -> float:
    """Forward FLOPs per token of one visit: the model minus the same model without it."""
    others = [v for v in cfg.latent_visits if v != visit]
    whole = forward_flops(cfg).total
    fewer = forward_flops(dataclasses.replace(cfg, iterations=cfg.iterations - 1,
                                              latent_visits=[v - (v > visit) for v in others],
                                              residual_scale_init=[])).total
    return float(whole - fewer)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--middle-layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=256)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--stride", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    init_distributed()
    cfg = preset("latentloop-tiny", hidden_size=args.hidden, num_attention_heads=args.heads,
                 num_layers=args.middle_layers + 2, num_experts=args.experts,
                 moe_top_k=args.top_k, moe_ffn_hidden_size=args.expert_ffn,
                 seq_length=args.seq, latent_stride=args.stride)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(cfg, params_dtype=dtype).to(device)
    visits = {"compressed": model.visits.visit1, "full": model.visits.visit2}
    assert visits["compressed"].compression is not None and visits["full"].compression is None
    rope = model.rotary_pos_emb(args.seq)
    hidden = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=dtype)

    def step(visit):
        x = hidden.detach().requires_grad_()
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
    flops = {"compressed": visit_flops(cfg, 1), "full": visit_flops(cfg, 2)}
    print(json.dumps({
        "config": {"hidden": args.hidden, "middle_layers": args.middle_layers,
                   "experts": args.experts, "top_k": args.top_k, "expert_ffn": args.expert_ffn,
                   "seq": args.seq, "stride": args.stride, "batch": args.batch,
                   "device": device, "dtype": str(dtype), "threads": torch.get_num_threads()},
        "median_s": median, "min_s": fastest,
        "time_saving_pct": {"median": 100 * (1 - median["compressed"] / median["full"]),
                            "min": 100 * (1 - fastest["compressed"] / fastest["full"])},
        "analytical_flop_saving_pct": 100 * (1 - flops["compressed"] / flops["full"]),
        "goal_saving_pct": 40.0,
        "all_s": times,
    }, indent=2))


if __name__ == "__main__":
    main()
