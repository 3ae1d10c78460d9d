"""A megatron-core MoE layer's forward+backward time against a dense SwiGLU FFN of equal active
parameters, in one run, and where the MoE layer's time goes. Prints JSON.

    python tools/bench/moe_layer.py [--hidden 512 --ffn 1376 --experts 8 --top-k 2 --tokens 4096]

The dense FFN has width F; the MoE layer has E experts of width F / k and routes every token to k
of them, so both spend 6 d F matmul FLOPs per token on their FFN weights (the router adds 2 d E).
Both are the FFNs megaloop's layer specs build (local spec on CPU: SequentialMLP experts behind the
allgather dispatcher; Transformer Engine on GPU: grouped GEMM, alltoall). They are timed alternately.
The breakdown times the MoE layer's phases (routing, dispatch, expert GEMMs, combine) in forward
and lists the profiler's top operators of a forward+backward step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from megaloop.cli import int_at_least

# Forward phases: (name, attribute path from the MoE layer, method).
PHASES = (("router", "", "route"), ("dispatch", "token_dispatcher", "token_dispatch"),
          ("permute", "token_dispatcher", "dispatch_postprocess"),
          ("expert_mlps", "experts", "forward"),
          ("unpermute", "token_dispatcher", "combine_preprocess"),
          ("combine", "token_dispatcher", "token_combine"))


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_at_least(1), default=512)
    parser.add_argument("--ffn", type=int_at_least(1), default=1376)
    parser.add_argument("--experts", type=int_at_least(1), default=8)
    parser.add_argument("--top-k", type=int_at_least(1), default=2)
    parser.add_argument("--tokens", type=int_at_least(1), default=4096)
    parser.add_argument("--repeats", type=int_at_least(1), default=15)
    args = parser.parse_args(argv)

    from megatron.core.transformer.spec_utils import build_module

    from megaloop.config import ModelConfig, ParallelConfig
    from megaloop.models import specs
    from megaloop.models.model import transformer_config
    from megaloop.platform.distributed import init_distributed

    init_distributed()
    use_te = specs.transformer_engine_available()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sizes = dict(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=4)
    configs = {"dense": ModelConfig(**sizes),
               "moe": ModelConfig(**sizes, num_experts=args.experts, moe_top_k=args.top_k,
                                  moe_ffn_hidden_size=args.ffn // args.top_k)}
    ffns = {}
    for name, cfg in configs.items():
        cfg.validate()
        config = transformer_config(cfg, ParallelConfig(), 1, args.ffn, dtype, use_te=use_te)
        spec = specs.layer_spec(cfg, "plain", use_te, moe=cfg.uses_moe).submodules.mlp
        extra = {"pg_collection": None} if cfg.uses_moe else {}
        ffns[name] = build_module(spec, config=config, **extra).to(device)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step(ffn):
        inp = x.detach().requires_grad_()
        ffn.zero_grad(set_to_none=True)
        out, _ = ffn(inp)
        out.float().square().mean().backward()
        sync()

    times = {name: [] for name in ffns}
    for ffn in ffns.values():
        step(ffn)
    for _ in range(args.repeats):
        for name, ffn in ffns.items():
            start = time.perf_counter()
            step(ffn)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    # On a shared machine other jobs only ever add time: the fastest repeat is the least disturbed.
    fastest = {name: min(t) for name, t in times.items()}

    # Forward phases of the MoE layer, timed by wrapping its methods (this process only).
    moe, phase_s = ffns["moe"], defaultdict(float)
    for phase, path, name in PHASES:
        owner = getattr(moe, path) if path else moe
        method = getattr(owner, name)

        def timed(*a, _method=method, _phase=phase, **k):
            sync()
            start = time.perf_counter()
            out = _method(*a, **k)
            sync()
            phase_s[_phase] += time.perf_counter() - start
            return out

        setattr(owner, name, timed)
    with torch.no_grad():
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            moe(x)
            sync()
            phase_s["whole_forward"] += time.perf_counter() - start
    whole = phase_s.pop("whole_forward")
    phase_s["other"] = whole - sum(phase_s.values())
    shares = {p: 100 * s / whole for p, s in phase_s.items()}  # before the profiled step adds more
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step(moe)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    print(json.dumps({
        "config": {**vars(args), "expert_ffn": args.ffn // args.top_k, "device": device,
                   "dtype": str(dtype), "transformer_engine": use_te,
                   "threads": torch.get_num_threads()},
        "median_s": median, "min_s": fastest,
        "moe_over_dense": {"median": median["moe"] / median["dense"],
                           "min": fastest["moe"] / fastest["dense"]},
        "moe_forward_phase_share_pct": shares,
        "moe_step_top_ops_self_cpu_ms": {e.key: e.self_cpu_time_total / 1e3 for e in top},
        "all_s": times,
    }, indent=2))


if __name__ == "__main__":
    main()
