"""Step time and peak memory of one AsymLoop without, with selective and with full activation
recomputation, side by side in one run. Prints JSON.

    OMP_NUM_THREADS=1 python tools/bench/recompute.py [--hidden 256 --layers 4 --seq 512
        --joint-attention fused|masked --repeats 5] [--selective core_attn mlp ...]
    OMP_NUM_THREADS=1 python tools/bench/recompute.py --experts 8 --shared-expert 256 \
        --selective core_attn moe shared_experts moe,shared_experts

``--selective``: one arm per entry, each a comma-separated ``parallel.recompute_modules`` list
(default: core_attn alone, megatron-core's default); ``--experts`` makes the FFNs MoE layers
(``--moe-layers decoder`` keeps the encoder's dense FFNs, which ``mlp`` replays). An arm naming a
module the model or backend lacks is one error line. The arms have equal weights and train on the
same tokens; they are timed alternately (the median of ``--repeats`` forward+backward steps each)
so that machine noise hits all of them; the process's CPU time per step beside the wall time (on a
CPU shared with other jobs the wall time also counts the waits for a core). Peak memory is the
peak of live tensor bytes during one forward+backward above what the model held before the step,
measured in an untimed step (``megaloop.scale.measure.StepMemory`` on CPU, which sees every tensor
an operator creates; ``torch.cuda.max_memory_allocated`` on a GPU). Beside them: the executed
FLOPs per token (``megaloop.models.flops``), which recomputation raises and MFU does not count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megaloop.cli import int_at_least, parsed_preset
from megaloop.models.flops import executed_backward_flops, forward_flops


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_at_least(1), default=256)
    parser.add_argument("--ffn", type=int_at_least(1), default=688)
    parser.add_argument("--heads", type=int_at_least(1), default=4)
    parser.add_argument("--layers", type=int_at_least(2), default=4)
    parser.add_argument("--seq", type=int_at_least(1), default=512)
    parser.add_argument("--vocab", type=int_at_least(1), default=8192)
    parser.add_argument("--iterations", type=int_at_least(1), default=3)
    parser.add_argument("--batch", type=int_at_least(1), default=1)
    parser.add_argument("--joint-attention", choices=("fused", "masked"), default="fused")
    parser.add_argument("--repeats", type=int_at_least(1), default=5)
    parser.add_argument("--selective", nargs="+", default=["core_attn"], metavar="MODULES",
                        help="one selective arm per entry: comma-separated recompute_modules")
    parser.add_argument("--experts", type=int_at_least(0), default=0, help="0: dense FFNs")
    parser.add_argument("--top-k", type=int_at_least(1), default=2)
    parser.add_argument("--expert-ffn", type=int_at_least(0), default=0,
                        help="expert width (0: the FFN width / top-k)")
    parser.add_argument("--shared-expert", type=int_at_least(0), default=0,
                        help="shared expert width (0: none)")
    parser.add_argument("--moe-layers", choices=("all", "encoder", "decoder"), default="all")
    args = parser.parse_args(argv)
    moe_options = {"--top-k": args.top_k != 2, "--expert-ffn": args.expert_ffn,
                   "--shared-expert": args.shared_expert, "--moe-layers": args.moe_layers != "all"}
    if not args.experts and any(moe_options.values()):
        parser.error(f"{', '.join(k for k, v in moe_options.items() if v)}: needs --experts > 0")
    if len(set(args.selective)) < len(args.selective):
        parser.error(f"--selective {' '.join(args.selective)}: each arm once")

    from megaloop.config import ConfigError, ParallelConfig
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed
    from megaloop.scale.measure import StepMemory

    init_distributed()
    cfg = parsed_preset(parser, "tiny", arch="asymloop", iterations=args.iterations,
                        hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                        num_attention_heads=args.heads, num_layers=args.layers,
                        seq_length=args.seq, vocab_size=args.vocab,
                        joint_attention=args.joint_attention,
                        **(dict(num_experts=args.experts, moe_top_k=args.top_k,
                                moe_ffn_hidden_size=args.expert_ffn or None,
                                moe_shared_expert_size=args.shared_expert,
                                moe_layers=args.moe_layers) if args.experts else {}))
    arms = {"none": ParallelConfig(), "full": ParallelConfig(recompute="full")}
    for entry in args.selective:
        modules = entry.split(",")
        arms["+".join(modules)] = ParallelConfig(recompute="selective", recompute_modules=modules)
    arms = dict(sorted(arms.items(), key=lambda arm: arm[0] == "full"))  # full last
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        models = {arm: build_model(cfg, parallel, params_dtype=dtype)
                  for arm, parallel in arms.items()}
    except ConfigError as e:
        parser.error(str(e))
    for model in models.values():
        model.load_state_dict(models["none"].state_dict())
        model.to(device)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_length), device=device)

    def step(model):
        model.zero_grad(set_to_none=True)
        model(x, labels=x).float().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()  # time the kernels, not their launch

    def peak_bytes(model) -> int:
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step(model)
            return torch.cuda.max_memory_allocated() - before
        with StepMemory() as memory:
            step(model)
        return memory.peak

    peaks = {mode: peak_bytes(model) for mode, model in models.items()}  # also the warm-up
    times = {mode: [] for mode in models}
    cpu_times = {mode: [] for mode in models}
    for _ in range(args.repeats):
        for mode, model in models.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step(model)
            times[mode].append(time.perf_counter() - start)
            cpu_times[mode].append(time.process_time() - cpu_start)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    cpu = {mode: statistics.median(t) for mode, t in cpu_times.items()}
    forward = forward_flops(cfg).total
    executed = {arm: float(forward + executed_backward_flops(cfg, parallel.recompute,
                                                             parallel.selective_modules))
                for arm, parallel in arms.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "config": dict(arch="asymloop", iterations=cfg.iterations, hidden=cfg.hidden_size,
                       layers=cfg.num_layers, heads=cfg.num_attention_heads, seq=cfg.seq_length,
                       batch=args.batch, joint_attention=cfg.joint_attention,
                       dtype=str(dtype).removeprefix("torch."), experts=cfg.num_experts,
                       shared_expert=cfg.moe_shared_expert_size if cfg.num_experts else 0,
                       moe_layers=cfg.moe_layers if cfg.num_experts else None),
        "step_ms": {mode: round(1e3 * t, 1) for mode, t in median.items()},
        "step_time_vs_none": {mode: round(t / median["none"], 3) for mode, t in median.items()},
        "step_cpu_ms": {mode: round(1e3 * t, 1) for mode, t in cpu.items()},
        "step_cpu_time_vs_none": {mode: round(t / cpu["none"], 3) for mode, t in cpu.items()},
        "peak_mib": {mode: round(b / 2**20, 1) for mode, b in peaks.items()},
        "peak_vs_none": {mode: round(b / peaks["none"], 3) for mode, b in peaks.items()},
        "executed_flops_vs_none": {mode: round(f / executed["none"], 3)
                                   for mode, f in executed.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
