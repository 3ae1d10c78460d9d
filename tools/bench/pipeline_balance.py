"""Pipeline stage balance of AsymLoop, measured on CPU: per-stage busy time under PP=2 and PP=4.
Prints JSON.

Each layout is one torchrun launch of ``megaloop.train``'s Trainer (one thread per process) for
``--steps`` steps; the first ``--warmup`` are not counted. A stage's busy time is the CPU time of
its process's main thread inside megatron-core's ``forward-compute`` and ``backward-compute`` timers
(``time.thread_time``: waiting for another stage or for a core, when several processes share one,
costs no CPU time, so the figure holds on an oversubscribed machine). Per layout the JSON gives the
split, each stage's busy seconds per step, the slowest stage against the mean (goal: <= 1.15 for the
balanced split), the layout chooser's predicted compute per stage, and the 1F1B bubble of a
schedule simulated from the measured per-micro-batch forward and backward times. Rows: the
balanced split of PP=2 and PP=4, and for comparison PP=2 split where the loop starts (the layout
before loops were unrolled: encoder | whole decoder loop) and PP=4 with equal application counts.

    python tools/bench/pipeline_balance.py [--hidden 128 --layers 8 --iterations 3 --seq 128
        --steps 5 --warmup 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from megaloop.cli import Stopped, child_failure, int_at_least, raise_stopped, signals_handled

GOAL = 1.15  # slowest stage / mean stage busy time
STOP_GRACE_S = 30  # for the stages to finish their step once stopped, as torchrun gives them


class ThreadTimers:
    """megatron-core's ``config.timers`` interface, summing main-thread CPU time per name."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}

    def __call__(self, name: str, log_level: int | None = None):
        timers = self

        class Timer:
            def start(self, barrier: bool = False):
                timers._started[name] = time.thread_time()

            def stop(self, barrier: bool = False):
                timers.total[name] += time.thread_time() - timers._started.pop(name)

        return Timer()


def worker(config_path: str, steps: int, warmup: int, out: str) -> None:
    """Inside torchrun: trains, then rank 0 writes every rank's busy times."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megaloop.config import load_yaml
    from megaloop.cli import quiet_third_party_warnings
    from megaloop.training.data import MicroBatches
    from megaloop.training.trainer import Trainer

    quiet_third_party_warnings()
    trainer = Trainer(load_yaml(config_path))
    timers = ThreadTimers()
    trainer.model.config.timers = timers
    cfg = trainer.cfg.train
    data = MicroBatches(trainer.train_data, cfg.micro_batch_size, trainer.dp_rank,
                        trainer.dp_size, 0, cfg.global_batch_size)
    for step in range(steps):
        if step == warmup:
            timers.total.clear()
        trainer.step += 1
        trainer.train_step(data)
        # The Trainer holds SIGTERM for its own loop, which this one replaces: unchecked, the
        # launcher's SIGTERM was taken and the steps ran on until its SIGKILL 30 s later. Its
        # check is the Trainer's own, agreed by every stage: one stopping alone would leave the
        # others waiting for its activations.
        if trainer.stop_requested():
            trainer.close()
            raise SystemExit(128 + int(trainer.stop_signals.received))
    counted = steps - warmup
    mine = {"stage": ps.get_pipeline_model_parallel_rank(),
            "forward_s": timers.total["forward-compute"] / counted,
            "backward_s": timers.total["backward-compute"] / counted}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    trainer.close()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every))


def simulate_1f1b(forward: list[float], backward: list[float], micro: int) -> float:
    """Step time of megatron-core's non-interleaved 1F1B schedule for stages taking ``forward[s]``
    and ``backward[s]`` per micro-batch, communication free."""
    stages = len(forward)
    orders = []
    for s in range(stages):
        warm = min(stages - s - 1, micro)
        ops = [("F", m) for m in range(warm)]
        for m in range(micro - warm):
            ops += [("F", warm + m), ("B", m)]
        ops += [("B", m) for m in range(micro - warm, micro)]
        orders.append(ops)
    done, free, position = {}, [0.0] * stages, [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                need = ((("F", s - 1, m) if s else None) if kind == "F"
                        else ("B", s + 1, m) if s < stages - 1 else ("F", s, m))
                if need is not None and need not in done:
                    break
                start = max(free[s], done.get(need, 0.0))
                free[s] = done[(kind, s, m)] = start + (forward[s] if kind == "F"
                                                        else backward[s])
                position[s] += 1
    return max(free)


def launch(command: list[str]) -> subprocess.CompletedProcess:
    """``command`` (torchrun) run to its end in a process group of its own, output captured. An
    interrupt or SIGTERM of the bench reaches the whole group, the launcher and its workers,
    which stop after their step; whatever is left after STOP_GRACE_S is killed. Before, the
    bench died alone, or killed only the launcher, and the workers trained on, orphaned."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True) as child:
        try:
            stdout, stderr = child.communicate()
        except BaseException:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):  # the group is gone already
                os.killpg(child.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def measure(name: str, cfg, split: list[int], args, tmp: Path) -> dict:
    from megaloop.config import save_yaml
    from megaloop.models.pipeline import balance

    run_dir = tmp / name
    run_dir.mkdir()
    cfg.parallel.pipeline, cfg.parallel.pipeline_split = len(split), split
    cfg.train.out_dir = str(run_dir)
    save_yaml(cfg, run_dir / "run.yaml")
    result = run_dir / "busy.json"
    failure = child_failure(launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={len(split)}", __file__, "--worker", str(run_dir / "run.yaml"),
         "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(result)]),
        f"the {name} launch")
    if failure:
        raise SystemExit(f"error: {failure}")
    ranks = sorted(json.loads(result.read_text()), key=lambda r: r["stage"])
    busy = [r["forward_s"] + r["backward_s"] for r in ranks]
    micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    step = simulate_1f1b([r["forward_s"] / micro for r in ranks],
                         [r["backward_s"] / micro for r in ranks], micro)
    mean = sum(busy) / len(busy)
    predicted = balance(cfg.model, split, len(split), micro)
    return {"split": split, "busy_s_per_step": [round(b, 4) for b in busy],
            "slowest_over_mean": round(max(busy) / mean, 3),
            "predicted_compute_over_ideal": [round(r, 3) for r in predicted.relative],
            "predicted_slowest_over_mean": round(max(predicted.relative)
                                                 / (sum(predicted.relative) / len(split)), 3),
            "bubble_1f1b_simulated": round(1 - sum(busy) / (len(busy) * step), 3),
            "bubble_1f1b_predicted": round(predicted.bubble, 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int_at_least(1), default=128)
    parser.add_argument("--layers", type=int_at_least(1), default=8)
    parser.add_argument("--iterations", type=int_at_least(1), default=3)
    parser.add_argument("--heads", type=int_at_least(1), default=4)
    parser.add_argument("--seq", type=int_at_least(1), default=128)
    parser.add_argument("--vocab", type=int_at_least(1), default=2048)
    parser.add_argument("--steps", type=int_at_least(1), default=5)
    parser.add_argument("--warmup", type=int_at_least(0), default=2)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.out)
    try:
        with signals_handled((signal.SIGTERM,), raise_stopped):
            run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    except Stopped as stop:
        print(f"stopped by signal {stop.signum}", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None


def run(args) -> None:
    """Every row's launch, then the JSON on stdout."""
    from megaloop.config import (CheckpointConfig, DataConfig, ModelConfig, RunConfig,
                                 TrainConfig)
    from megaloop.models.pipeline import balanced_split, chain_length
    from tools.bench.train_throughput import write_dataset

    model = ModelConfig(arch="asymloop", iterations=args.iterations, num_layers=args.layers,
                        hidden_size=args.hidden, ffn_hidden_size=int(2.6875 * args.hidden),
                        num_attention_heads=args.heads, vocab_size=args.vocab,
                        seq_length=args.seq).resolve()
    total, encoder = chain_length(model), model.num_encoder_layers
    rows = {"pp2_balanced": balanced_split(model, 2),
            "pp2_encoder_then_loop": [encoder, total - encoder],
            "pp4_balanced": balanced_split(model, 4),
            "pp4_equal_counts": [total // 4 + (i < total % 4) for i in range(4)]}
    result = {"config": {"arch": "asymloop", "iterations": args.iterations,
                         "layers": args.layers, "hidden": args.hidden, "seq": args.seq,
                         "vocab": args.vocab, "micro_batch": 2, "global_batch": 16,
                         "threads_per_stage": 1, "steps_counted": args.steps - args.warmup},
              "goal_slowest_over_mean": GOAL}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = write_dataset(Path(tmp) / "data", args.vocab)
        for name, split in rows.items():
            cfg = RunConfig(model=model,
                            train=TrainConfig(micro_batch_size=2, global_batch_size=16,
                                              train_steps=args.steps, tensorboard=False,
                                              log_interval=10**6),
                            data=DataConfig(path=[prefix], split="100,0,0", eod_id=0),
                            checkpoint=CheckpointConfig(resume=False))
            result[name] = measure(name, cfg, split, args, Path(tmp))
    for name in ("pp2_balanced", "pp4_balanced"):
        result[name]["goal_met"] = result[name]["slowest_over_mean"] <= GOAL
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
