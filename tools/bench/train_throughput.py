"""Training throughput, two rows. Prints JSON.

1. ``dense``: megaloop's Dense Trainer against a plain megatron-core GPTModel loop on the same
   config, data, optimizer and schedule, in one process.
2. ``looped``: AsymLoop (K=3) trained by ``megaloop.train`` under TP=2 and under PP=2 (two
   processes of one thread each) against one process of two threads, tokens/s ratio. Each layout
   is a torchrun launch of ``--looped-steps`` steps (the first two, warm-up, are not counted),
   repeated ``--rounds`` times in alternation; the figure is the median step time from
   metrics.jsonl.

    python tools/bench/train_throughput.py [--rows dense looped] [--hidden 256 --layers 4
        --seq 256 --steps 6 --rounds 3 --looped-steps 8]

Both loops use DDP, the distributed optimizer and get_forward_backward_func over the same
megatron-core GPTDataset. They run in alternating blocks of ``--steps`` steps so that machine noise
hits both; the figure is the median step time. The megaloop side includes its per-step monitoring.
The plain GPTModel is measured twice: with megatron-core's own local spec (DotProductAttention,
which builds the full score matrix) and with the same SDPA core attention megaloop's local spec
uses, so that the second ratio isolates framework overhead. Goal: ratio >= 0.95. The
``cpu_ratio_*`` fields are the same ratios by the process's CPU time per step, which waits for a
core on a shared machine do not inflate.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from megaloop.cli import child_failure, int_at_least


def write_dataset(prefix: Path, vocab: int, documents: int = 2000) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        doc = rng.integers(1, vocab, size=int(rng.integers(100, 600)))
        builder.add_item(torch.from_numpy(np.append(doc, 0).astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


class PlainGPTLoop:
    """The reference: megatron-core's GPTModel trained the way its own examples do."""

    def __init__(self, trainer, sdpa_attention: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megaloop.models.layers import CausalCoreAttention
        from megaloop.training.optimizer import build_optimizer

        cfg = trainer.cfg
        # Same TransformerConfig fields as megaloop's Dense; a copy, since the loop's hooks below
        # must not replace the megaloop trainer's.
        config = copy.copy(trainer.model.config)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if sdpa_attention:
            spec.submodules.self_attention.submodules.core_attention = CausalCoreAttention
        model = GPTModel(config, spec, vocab_size=cfg.model.vocab_size,
                         max_sequence_length=cfg.model.seq_length, position_embedding_type="rope")
        self.ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                  grad_reduce_in_fp32=True), model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.ddp.no_sync
        self.optimizer, self.scheduler, _ = build_optimizer([self.ddp], [model], cfg)
        n = cfg.model.seq_length
        self.mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)
        self.cfg, self.num_microbatches = cfg, trainer.num_microbatches

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], self.mask, labels=batch["labels"])

        def loss_func(per_token):
            total = per_token.float().sum()
            return total, torch.tensor(per_token.numel()), {"lm loss": total.detach()}

        return output, loss_func

    def step(self, data) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=self.forward_step, data_iterator=data, model=[self.ddp],
            num_microbatches=self.num_microbatches, seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.train.micro_batch_size, forward_only=False)
        self.optimizer.step()
        self.scheduler.step(increment=1)


def dense_row(args) -> dict:
    """megaloop's Dense training loop against plain megatron-core GPTModel loops."""
    from megaloop.config import (CheckpointConfig, DataConfig, ModelConfig, RunConfig,
                                 TrainConfig)
    from megaloop.training.data import MicroBatches
    from megaloop.training.trainer import Trainer

    total_steps = 2 * args.steps * args.rounds + 10
    with tempfile.TemporaryDirectory() as tmp:
        prefix = write_dataset(Path(tmp) / "bench", args.vocab)
        cfg = RunConfig(
            model=ModelConfig(arch="dense", iterations=1, num_layers=args.layers,
                              hidden_size=args.hidden, ffn_hidden_size=int(2.6875 * args.hidden),
                              num_attention_heads=args.heads, vocab_size=args.vocab,
                              seq_length=args.seq),
            train=TrainConfig(micro_batch_size=4, global_batch_size=8, train_steps=total_steps,
                              out_dir=str(Path(tmp) / "run"), tensorboard=False,
                              log_interval=10**6),
            data=DataConfig(path=[prefix], split="100,0,0", eod_id=0),
            checkpoint=CheckpointConfig(resume=False),
        )
        trainer = Trainer(cfg)
        loops = {"plain_mcore_local_spec": PlainGPTLoop(trainer, sdpa_attention=False),
                 "plain_mcore_sdpa": PlainGPTLoop(trainer, sdpa_attention=True)}

        def megaloop_step(data):
            trainer.step += 1
            start = time.perf_counter()
            outcome = trainer.train_step(data)
            trainer.monitor.log_step(trainer.step, loss=outcome.loss, lr=outcome.lr,
                                     grad_norm=outcome.grad_norm,
                                     step_time_s=time.perf_counter() - start,
                                     skipped=outcome.skipped, loss_tokens=outcome.loss_tokens)

        steppers = {"megaloop": megaloop_step, **{k: v.step for k, v in loops.items()}}
        data = {name: MicroBatches(trainer.train_data, 4, 0, 1, 0, 8) for name in steppers}
        times = {name: [] for name in steppers}
        cpu_times = {name: [] for name in steppers}

        def timed(name) -> float:
            start, cpu_start = time.perf_counter(), time.process_time()
            steppers[name](data[name])
            elapsed = time.perf_counter() - start
            cpu_times[name].append(time.process_time() - cpu_start)
            # The Trainer holds SIGTERM/SIGUSR1 for its own loop, which this one replaces.
            received = trainer.stop_signals.received
            if received is not None:
                trainer.close()
                print(f"stopped by signal {int(received)}", file=sys.stderr)
                raise SystemExit(128 + int(received))
            return elapsed

        for name in steppers:  # warm-up
            timed(name)
        for _ in range(args.rounds):
            for name in steppers:
                times[name] += [timed(name) for _ in range(args.steps)]
        trainer.close()
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    median = {name: statistics.median(t) for name, t in times.items()}
    cpu = {name: statistics.median(t[1:]) for name, t in cpu_times.items()}  # t[0]: warm-up
    result = {
        "config": {"hidden": args.hidden, "layers": args.layers, "seq": args.seq,
                   "vocab": args.vocab, "global_batch": cfg.train.global_batch_size},
        "tokens_per_s": {name: tokens / t for name, t in median.items()},
        "ratio_vs_plain_mcore_sdpa": median["plain_mcore_sdpa"] / median["megaloop"],
        "ratio_vs_plain_mcore_local_spec": median["plain_mcore_local_spec"] / median["megaloop"],
        # the process's CPU time per step: on a shared machine the wall time also counts the
        # waits for a core, which need not hit the loops alike
        "cpu_ratio_vs_plain_mcore_sdpa": cpu["plain_mcore_sdpa"] / cpu["megaloop"],
        "cpu_ratio_vs_plain_mcore_local_spec": cpu["plain_mcore_local_spec"] / cpu["megaloop"],
    }
    result["goal_met"] = result["ratio_vs_plain_mcore_sdpa"] >= 0.95
    return result


LOOPED_LAYOUTS = ("single", "tp2", "pp2")


def looped_row(args, tmp: Path) -> dict:
    """AsymLoop tokens/s under TP=2 and PP=2 against one process, with the same two cores."""
    import os
    import subprocess

    from megaloop.config import (CheckpointConfig, DataConfig, ModelConfig, RunConfig,
                                 TrainConfig, save_yaml)
    from megaloop.scale.layout import parse_layout
    from megaloop.scale.loss_compare import read_curve

    prefix = write_dataset(tmp / "looped", args.vocab)
    base = RunConfig(
        model=ModelConfig(arch="asymloop", iterations=3, num_layers=args.layers,
                          hidden_size=args.hidden, ffn_hidden_size=int(2.6875 * args.hidden),
                          num_attention_heads=args.heads, vocab_size=args.vocab,
                          seq_length=args.seq),
        train=TrainConfig(micro_batch_size=2, global_batch_size=8, train_steps=args.looped_steps,
                          tensorboard=False, log_interval=1),
        data=DataConfig(path=[prefix], split="100,0,0", eod_id=0),
        checkpoint=CheckpointConfig(resume=False))
    times = {name: [] for name in LOOPED_LAYOUTS}
    for round_index in range(args.rounds):
        for name in LOOPED_LAYOUTS:
            layout = parse_layout(name)
            run_dir = tmp / f"{name}_{round_index}"
            cfg = layout.apply(base)
            cfg.train.out_dir = str(run_dir)
            run_dir.mkdir()
            save_yaml(cfg, run_dir / "run.yaml")
            threads = 2 // layout.world_size  # the same two cores for every layout
            failure = child_failure(subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={layout.world_size}", "-m", "megaloop.train",
                 "--config", str(run_dir / "run.yaml")], capture_output=True, text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)}), f"the {name} launch")
            if failure:
                raise SystemExit(f"error: {failure}")
            read_curve(run_dir)  # a run without a complete log fails here
            records = [json.loads(line) for line in
                       (run_dir / "metrics.jsonl").read_text().splitlines()]
            times[name] += [r["step_time_s"] for r in records
                            if r.get("kind") == "train" and r["step"] > 2]
    tokens = base.train.global_batch_size * args.seq
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"config": {"arch": "asymloop", "iterations": 3, "hidden": args.hidden,
                       "layers": args.layers, "seq": args.seq, "global_batch": 8,
                       "micro_batch": 2, "cores": 2},
            "tokens_per_s": {name: tokens / t for name, t in median.items()},
            "ratio_tp2_vs_single": median["single"] / median["tp2"],
            "ratio_pp2_vs_single": median["single"] / median["pp2"]}


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=("dense", "looped"),
                        default=["dense", "looped"])
    parser.add_argument("--looped-steps", type=int_at_least(1), default=8,
                        help="steps per looped launch")
    parser.add_argument("--hidden", type=int_at_least(1), default=256)
    parser.add_argument("--layers", type=int_at_least(1), default=4)
    parser.add_argument("--heads", type=int_at_least(1), default=4)
    parser.add_argument("--seq", type=int_at_least(1), default=256)
    parser.add_argument("--vocab", type=int_at_least(1), default=4096)
    parser.add_argument("--steps", type=int_at_least(1), default=6, help="steps per block")
    parser.add_argument("--rounds", type=int_at_least(1), default=3,
                        help="alternating blocks per loop")
    args = parser.parse_args(argv)

    from megaloop.cli import quiet_third_party_warnings

    quiet_third_party_warnings()
    result = {}
    if "dense" in args.rows:
        # The Trainer's progress lines go to stderr, so that stdout is the JSON alone.
        with contextlib.redirect_stdout(sys.stderr):
            result["dense"] = dense_row(args)
    if "looped" in args.rows:
        with tempfile.TemporaryDirectory() as tmp:
            result["looped"] = looped_row(args, Path(tmp))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
