"""checkpoint.async_save off and on, side by side: the same small training run (the same data,
seed and saves) with each, alternately (in order in even rounds, reversed in odd ones), in one
process on the CPU. Prints JSON. A third mode, ``sync_in_trainer``, saves synchronously as
megatron-core's own synchronous save does, the write in the training process (the workers forked
from it), not in megaloop's watched writer process: what that process costs a synchronous save
(``sync_writer_process_s_per_save``); megaloop does not save so, since a worker killed mid-write
would leave the save waiting for ever (megaloop.training.checkpoint_writer).

    OMP_NUM_THREADS=1 python tools/bench/async_save.py [--steps 24 --save-interval 4 --rounds 2]

Per save (megaloop.training.checkpoint_save.CheckpointSaver.timings): ``blocked_s``, the seconds
the training loop spent on it (staging the state, scheduling the write, the polls, the finalize,
any wait), and with async_save ``background_s``, the seconds from the start of its write until a
poll found it complete. The periodic saves are those before the last step's: the final save waits
for its write in either mode. ``train_s``: the whole run's wall time, the steps during a
background write included (on a machine with few cores the writer takes CPU from them). The
results-queue manager megatron-core's writer starts at the first save of a process is started
before the first run, so that no run pays it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from megaloop.cli import int_at_least

MODES = ("sync", "async", "sync_in_trainer")


def _write_data(prefix: Path, documents: int = 400, vocab: int = 1024, seed: int = 0) -> str:
    """Random documents of 64-256 tokens as a megatron-core indexed dataset (EOD 0)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        doc = rng.integers(1, vocab, size=int(rng.integers(64, 256)))
        builder.add_item(torch.from_numpy(np.append(doc, 0).astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _config(args, data: str, out_dir: Path, asynchronous: bool):
    from megaloop.config import (CheckpointConfig, DataConfig, ModelConfig, RunConfig,
                                 TrainConfig)

    return RunConfig(
        model=ModelConfig(arch="asymloop", num_layers=args.layers, hidden_size=args.hidden_size,
                          ffn_hidden_size=4 * args.hidden_size, num_attention_heads=8,
                          vocab_size=1024, seq_length=128, iterations=2),
        train=TrainConfig(micro_batch_size=2, global_batch_size=2, train_steps=args.steps,
                          out_dir=str(out_dir), log_interval=10**6, eval_iters=1,
                          tensorboard=False),
        data=DataConfig(path=[data], split="98,2,0", eod_id=0,
                        cache_dir=str(out_dir.parent / "cache")),
        checkpoint=CheckpointConfig(save_interval=args.save_interval, keep_last=2,
                                    async_save=asynchronous))


def _write_in_trainer(save, state, queue) -> None:
    """In place of checkpoint_save._write: megatron-core's own synchronous save (the request
    executed in this process), after the same agreement that every rank got this far."""
    from megatron.core import dist_checkpointing

    from megaloop.training.collective import any_rank

    request = dist_checkpointing.save(state, str(save.tmp), async_sharded_save=True)
    any_rank(False)
    request.execute_sync()


def _run(args, data: str, out_dir: Path, mode: str) -> dict:
    from megaloop.training import checkpoint_save
    from megaloop.training.trainer import Trainer

    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # stdout is the JSON's
        if mode == "sync_in_trainer":
            stack.enter_context(mock.patch.object(checkpoint_save, "_write", _write_in_trainer))
        trainer = Trainer(_config(args, data, out_dir, mode == "async"))
        started = time.perf_counter()
        result = trainer.train()
        train_s = time.perf_counter() - started
    if result.get("stopped_by_signal"):  # the Trainer saved and stopped: so does the bench
        raise SystemExit(128 + int(result["stopped_by_signal"]))
    saves = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}
             for t in trainer.saver.timings]
    size = sum(f.stat().st_size for f in (out_dir / "checkpoints" / f"iter_{args.steps:07d}")
               .iterdir())
    return {"mode": mode, "train_s": round(train_s, 2), "checkpoint_mb": round(size / 2**20, 1),
            "saves": saves}


def _summary(runs: list[dict], steps: int) -> dict:
    summary = {}
    for mode in MODES:
        periodic = [s for run in runs if run["mode"] == mode for s in run["saves"]
                    if s["step"] != steps]
        blocked = [s["blocked_s"] for s in periodic]
        summary[mode] = {"periodic_saves": len(periodic),
                         "blocked_s_per_save_median": round(statistics.median(blocked), 3),
                         "blocked_s_per_save_mean": round(statistics.mean(blocked), 3),
                         "train_s": [run["train_s"] for run in runs if run["mode"] == mode]}
        if mode == "async":
            summary[mode]["background_s_median"] = round(
                statistics.median(s["background_s"] for s in periodic), 3)
    summary["async_over_sync_blocked"] = round(
        summary["async"]["blocked_s_per_save_median"]
        / summary["sync"]["blocked_s_per_save_median"], 3)
    summary["sync_writer_process_s_per_save"] = round(
        summary["sync"]["blocked_s_per_save_median"]
        - summary["sync_in_trainer"]["blocked_s_per_save_median"], 3)
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int_at_least(2), default=24)
    parser.add_argument("--save-interval", type=int_at_least(1), default=4)
    parser.add_argument("--hidden-size", type=int_at_least(1), default=512,
                        help="8 attention heads: a multiple of 64")
    parser.add_argument("--layers", type=int_at_least(2), default=4)
    parser.add_argument("--rounds", type=int_at_least(1), default=2,
                        help="runs of each mode, alternating which goes first")
    args = parser.parse_args(argv)
    if args.save_interval >= args.steps:
        parser.error(f"argument --save-interval: {args.save_interval}: must be below --steps "
                     f"{args.steps} (a periodic save before the final one)")
    from megaloop.config import ConfigError

    try:  # the model's sizes, before any work
        _config(args, "", Path("."), True).validate()
    except ConfigError as e:
        parser.error(str(e))
    from megaloop.cli import log_to_stderr, quiet_third_party_warnings

    quiet_third_party_warnings()
    log_to_stderr()
    # A process's first save starts it (a spawned process: seconds).
    from megaloop.training.checkpoint_writer import start_results_queue

    start_results_queue()
    with tempfile.TemporaryDirectory(prefix="megaloop-async-save-") as workdir:
        work = Path(workdir)
        data = _write_data(work / "random")
        # Each mode first in every other round: the first save of a process is the slowest.
        runs = [_run(args, data, work / f"{mode}{index}", mode)
                for index in range(args.rounds) for mode in MODES[::1 - 2 * (index % 2)]]
    print(json.dumps({"config": {"steps": args.steps, "save_interval": args.save_interval,
                                 "hidden_size": args.hidden_size, "layers": args.layers,
                                 "rounds": args.rounds},
                      "summary": _summary(runs, args.steps), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
