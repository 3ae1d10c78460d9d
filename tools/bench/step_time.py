"""Forward+backward step time of AsymLoop K=3 against Full Loop R=2 at matched effective depth, in one
run, beside the analytical FLOP ratio; on a GPU also tokens/s and MFU. Prints JSON.

    python tools/bench/step_time.py [--hidden 256 --layers 4 --seq 1024 --repeats 5]
    python tools/bench/step_time.py --preset 1B --batch 8       # a preset's size, e.g. on a GPU

Both models are megatron-core LoopedLMs on the same backend and attention kernel family (bf16 on
CUDA, fp32 on CPU); the two are timed alternately so that machine noise hits both. MFU is model
FLOPs (3x the analytical forward) over the device's dense bf16 peak; the optimizer step is left out
(for a 1B model it moves ~20 GB, a few ms per step on an H100-class GPU). Goal (issue 2): measured
overhead <= analytical overhead + 3 points. On a CPU also each step's process CPU time
(``step_cpu_ms``, ``measured_cpu_overhead_pct``): on a machine shared with other jobs the wall time
counts the waits for a core too, the CPU time only this process's work (one thread:
OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from megaloop.models.flops import forward_flops, model_flops_per_token
from megaloop.cli import int_at_least, parsed_preset
from megaloop.training.monitor import peak_tflops

SIZE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_layers", "seq_length",
               "vocab_size")


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_at_least(1), default=256)
    parser.add_argument("--ffn", type=int_at_least(1), default=688)
    parser.add_argument("--heads", type=int_at_least(1), default=4)
    parser.add_argument("--layers", type=int_at_least(1), default=4)
    parser.add_argument("--seq", type=int_at_least(1), default=1024)
    parser.add_argument("--vocab", type=int_at_least(1), default=8192)
    parser.add_argument("--batch", type=int_at_least(1), default=1)
    parser.add_argument("--repeats", type=int_at_least(1), default=5)
    parser.add_argument("--profile", type=int_at_least(1), default=0, metavar="OPS",
                        help="also profile one step of each model and print the OPS operators "
                             "whose self time (device time on a GPU) differs most between them")
    parser.add_argument("--preset", help="take the size (hidden, FFN, heads, layers, sequence, "
                                         "vocabulary) from this preset instead")
    args = parser.parse_args(argv)

    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    init_distributed()
    size = dict(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
                num_layers=args.layers, seq_length=args.seq, vocab_size=args.vocab)
    base = "tiny"
    if args.preset:
        base, size = args.preset, {}
    configs = {"asymloop_k3": parsed_preset(parser, base, arch="asymloop", iterations=3, **size),
               "fullloop_r2": parsed_preset(parser, base, arch="fullloop", iterations=2, **size)}
    seq, vocab = configs["asymloop_k3"].seq_length, configs["asymloop_k3"].vocab_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CUDA flash needs bf16/fp16
    models = {name: build_model(cfg, params_dtype=dtype).to(device)
              for name, cfg in configs.items()}
    x = torch.randint(0, vocab, (args.batch, seq), device=device)

    def step(model):
        model.zero_grad(set_to_none=True)
        model(x, labels=x).float().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()  # time the kernels, not their launch

    times = {name: [] for name in models}
    cpu_times = {name: [] for name in models}
    for model in models.values():
        step(model)  # warm-up
    for _ in range(args.repeats):
        for name, model in models.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step(model)
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    median = {name: statistics.median(t) for name, t in times.items()}
    cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    flops = {name: forward_flops(cfg).total for name, cfg in configs.items()}
    measured = 100 * (median["asymloop_k3"] / median["fullloop_r2"] - 1)
    analytical = 100 * (flops["asymloop_k3"] / flops["fullloop_r2"] - 1)
    tokens = args.batch * seq
    flops_per_s = {name: model_flops_per_token(configs[name]) * tokens / t
                   for name, t in median.items()}
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "preset": args.preset,
        "batch": args.batch,
        "config": {k: v for k, v in dataclasses.asdict(configs["asymloop_k3"]).items()
                   if k in SIZE_FIELDS or k in ("block", "joint_attention")},
        "effective_depth": configs["asymloop_k3"].effective_depth,
        "step_ms": {name: 1e3 * t for name, t in median.items()},
        "tokens_per_s": {name: tokens / t for name, t in median.items()},
        "model_gflops_per_s": {name: f / 1e9 for name, f in flops_per_s.items()},
        "measured_overhead_pct": measured,
        "analytical_overhead_pct": analytical,
        "goal_met": measured <= analytical + 3.0,
    }
    if device == "cpu":  # a shared CPU: waits for a core inflate the wall times, not these
        result["step_cpu_ms"] = {name: 1e3 * t for name, t in cpu.items()}
        result["measured_cpu_overhead_pct"] = 100 * (cpu["asymloop_k3"] / cpu["fullloop_r2"] - 1)
    peak = peak_tflops(result["device"], "bf16") if device == "cuda" else None
    if peak is not None:
        result["mfu"] = {name: f / (peak * 1e12) for name, f in flops_per_s.items()}
        result["peak_bf16_tflops"] = peak
    if args.profile:
        result["profile"] = _profile(models, step, args.profile, device)
    print(json.dumps(result, indent=2))


def _profile(models, step, top: int, device: str) -> dict:
    """Self time per operator of one step of each model, in ms: the ``top`` operators whose time
    differs most between the models, and each model's total. On a GPU the device time of the
    kernels each operator launched; on a CPU its own CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    per_model = {}
    for name, model in models.items():
        with profile(activities=activities) as prof:
            step(model)
        # Operator rows only (DeviceType.CPU): kernel rows repeat the time of the operator that
        # launched them.
        per_model[name] = {
            event.key: (event.self_device_time_total if device == "cuda"
                        else event.self_cpu_time_total) / 1e3
            for event in prof.key_averages() if event.device_type == DeviceType.CPU}
    ops = set().union(*per_model.values())
    spread = {op: max(t.get(op, 0.0) for t in per_model.values())
              - min(t.get(op, 0.0) for t in per_model.values()) for op in ops}
    return {"time": "device" if device == "cuda" else "cpu",
            "total_ms": {name: sum(t.values()) for name, t in per_model.items()},
            "ms_by_op": {op: {name: t.get(op, 0.0) for name, t in per_model.items()}
                         for op in sorted(ops, key=spread.get, reverse=True)[:top]}}


if __name__ == "__main__":
    main()
