"""Forward+backward step time of AsymLoop K=3 against Full Loop R=2 at matched effective depth, in one
run, beside the analytical FLOP ratio. Prints JSON.

    python tools/bench/step_time.py [--hidden 256 --layers 4 --seq 1024 --repeats 5]

Both models are megatron-core LoopedLMs on the same backend and attention kernel family; the two are
timed alternately so that machine noise hits both. Goal (issue 2): measured overhead <= analytical
overhead + 3 points.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from megaloop.models.flops import forward_flops, model_flops_per_token
from megaloop.presets import preset


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    init_distributed()
    size = dict(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
                num_layers=args.layers, seq_length=args.seq, vocab_size=args.vocab)
    configs = {"asymloop_k3": preset("tiny", arch="asymloop", iterations=3, **size),
               "fullloop_r2": preset("tiny", arch="fullloop", iterations=2, **size)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CUDA flash needs bf16/fp16
    models = {name: build_model(cfg, params_dtype=dtype) for name, cfg in configs.items()}
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    def step(model):
        model.zero_grad(set_to_none=True)
        model(x, labels=x).float().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()  # time the kernels, not their launch

    times = {name: [] for name in models}
    for model in models.values():
        step(model)  # warm-up
    for _ in range(args.repeats):
        for name, model in models.items():
            start = time.perf_counter()
            step(model)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    flops = {name: forward_flops(cfg).total for name, cfg in configs.items()}
    measured = 100 * (median["asymloop_k3"] / median["fullloop_r2"] - 1)
    analytical = 100 * (flops["asymloop_k3"] / flops["fullloop_r2"] - 1)
    tokens = args.batch * args.seq
    result = {
        "config": {k: v for k, v in dataclasses.asdict(configs["asymloop_k3"]).items()
                   if k in size or k in ("block", "joint_attention")},
        "effective_depth": configs["asymloop_k3"].effective_depth,
        "step_ms": {name: 1e3 * t for name, t in median.items()},
        "model_gflops_per_s": {name: model_flops_per_token(configs[name]) * tokens / t / 1e9
                               for name, t in median.items()},
        "measured_overhead_pct": measured,
        "analytical_overhead_pct": analytical,
        "goal_met": measured <= analytical + 3.0,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
