"""Joint Global+Local attention: fused (two flash calls merged by log-sum-exp) vs the exact masked
reference, forward + backward, on CPU (fp32) or CUDA (bf16). Prints JSON.

    python tools/bench/joint_attention.py [--seq 1024 --heads 4 --head-dim 64 --repeats 5]
    python tools/bench/joint_attention.py --device cuda --batch 4 --heads 16 --head-dim 128

Time: median over repeats, the two implementations interleaved in one process so that machine
noise hits both (on CUDA each step is synchronised). Peak memory: on CPU each implementation runs
once in a fresh child process, and the figure is its peak RSS above the RSS it had with the inputs
allocated and a tiny warm-up call done; on CUDA it is the allocator's peak above the memory
allocated before the step. Accuracy: each output's relative error against float64.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import psutil
import torch

from megaloop.cli import int_at_least
from megaloop.models.joint_attention import joint_attention_fused
from megaloop.reference.modeling_asymloop import joint_attention as joint_attention_masked

IMPLS = {"fused": joint_attention_fused, "masked": joint_attention_masked}


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32  # CUDA flash: bf16/fp16 only


def _inputs(args):
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    return [torch.randn(shape, generator=g).to(args.device, _dtype(args.device))
            .requires_grad_() for _ in range(5)]


def _step(impl, inputs, scale):
    out = IMPLS[impl](*inputs, scale)
    out.backward(torch.ones_like(out))
    for t in inputs:
        t.grad = None
    if out.is_cuda:
        torch.cuda.synchronize()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM missing from /proc/self/status (Linux only)")


def _peak_child(impl, args, queue):
    torch.set_num_threads(args.threads)
    inputs = _inputs(args)
    # A tiny call first, so thread pools and allocator arenas are not billed to the kernel.
    small = argparse.Namespace(**{**vars(args), "seq": 16})
    _step(impl, _inputs(small), args.head_dim ** -0.5)
    baseline = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak-RSS mark (VmHWM)
        f.write("5")
    _step(impl, inputs, args.head_dim ** -0.5)
    queue.put(max(_peak_rss() - baseline, 0))


def _peak_cuda(impl, args) -> int:
    inputs = _inputs(args)
    _step(impl, inputs, args.head_dim ** -0.5)  # warm-up
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(impl, inputs, args.head_dim ** -0.5)
    return torch.cuda.max_memory_allocated() - baseline


def peak_memory(impl, args) -> int:
    if args.device == "cuda":
        return _peak_cuda(impl, args)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(impl, args, queue))
    proc.start()
    value = queue.get(timeout=600)
    proc.join()
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int_at_least(1), default=1)
    parser.add_argument("--heads", type=int_at_least(1), default=4)
    parser.add_argument("--seq", type=int_at_least(1), default=1024)
    parser.add_argument("--head-dim", type=int_at_least(1), default=64)
    parser.add_argument("--repeats", type=int_at_least(1), default=5)
    parser.add_argument("--threads", type=int_at_least(1), default=torch.get_num_threads())
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    inputs, scale = _inputs(args), args.head_dim ** -0.5
    times = {impl: [] for impl in IMPLS}
    for impl in IMPLS:  # warm-up
        _step(impl, inputs, scale)
    for _ in range(args.repeats):
        for impl in IMPLS:
            start = time.perf_counter()
            _step(impl, inputs, scale)
            times[impl].append(time.perf_counter() - start)
    with torch.no_grad():
        exact = joint_attention_masked(*[t.double() for t in inputs], scale)
        errors = {impl: ((fn(*inputs, scale).double() - exact).norm() / exact.norm()).item()
                  for impl, fn in IMPLS.items()}
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": str(_dtype(args.device)).removeprefix("torch."),
        "shape": {"batch": args.batch, "heads": args.heads, "seq": args.seq,
                  "head_dim": args.head_dim},
        "threads": args.threads,
        "fwd_bwd_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "peak_bytes_above_inputs": {impl: peak_memory(impl, args) for impl in IMPLS},
        "forward_rel_error_vs_fp64": errors,
    }
    result["speedup"] = result["fwd_bwd_ms"]["masked"] / result["fwd_bwd_ms"]["fused"]
    peak = result["peak_bytes_above_inputs"]
    result["memory_ratio_fused_over_masked"] = peak["fused"] / max(peak["masked"], 1)
    result["goals"] = {"speedup>=3": result["speedup"] >= 3,
                       "memory_ratio<=0.25": result["memory_ratio_fused_over_masked"] <= 0.25}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
