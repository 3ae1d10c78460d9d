"""Fine-tune a megaloop checkpoint on GSM8K (AsymLoop paper, Appendix H.2) with the ordinary trainer.

    python tools/finetune_gsm8k.py --base runs/asym1b/checkpoints --data gsm8k_train.jsonl \\
        --out runs/asym1b_gsm8k [--epochs 3] [train.micro_batch_size=8 parallel.tensor=2 ...]
    torchrun --nproc-per-node 8 tools/finetune_gsm8k.py ...   (same arguments)

The run takes the base checkpoint's model and tokenizer and starts from its weights with a fresh
optimizer; megaloop.gsm8k.RECIPE sets the paper's settings (AdamW 1e-4, cosine with 10% warmup,
batch 32, context 1024, 6,973 train / 500 development records, loss on solution tokens only), then
the dotted overrides apply (not to what --base, --data and --out set: checkpoint.load, data.path
and train.out_dir). ``train.train_steps`` is ``--epochs`` (default 3) passes over the
training records that fit the context, rounded up, unless given as an override (not both). The
run is ``megaloop-train --config`` on the resolved config, which goes to ``<out>/finetune.yaml``
(atomically) once the trainer has set the run up to train, so that a run refused at set-up leaves
``<out>`` as it was, and a finished run relaunched its config (settings changed since are not
applied to it). Checkpoints, metrics and exit codes are megaloop-train's (0 done, 2 bad
config/data/checkpoint, 3 aborted, 75 preempted); running the command again resumes from
``<out>/checkpoints``, from the base checkpoint the run started from even where ``--base`` (a run's
directory) has a newer one by then (megaloop.gsm8k.resumed_config). A rerun the resume would
refuse is refused before anything is written.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def set_by_options() -> dict[str, str]:
    """For refuse_overrides_of: every field the options set (gsm8k.finetune_settings) and the
    option that sets it; an override of one would silently lose to its option (weights from
    another checkpoint than --base's model, the run outside --out, other data than --data)."""
    from megaloop import gsm8k
    from megaloop.cli import set_by

    return set_by(gsm8k.finetune_settings("--base", ["--data"], "--out"),
                  ("--base", "--data", "--out"), "the tool")


def is_override(word: str) -> bool:
    """Whether ``word`` is a ``section.field=value`` override rather than a data file: a dotted
    key before "=" and no such file (a misspelt section is then named as such, not as a missing
    data file)."""
    key, sep, _ = word.partition("=")
    return bool(sep) and "." in key and "/" not in key and not os.path.exists(word)


def main(argv: list[str] | None = None, *, then_exit: bool = False) -> int:
    from megaloop.cli import ArgumentParser  # usage errors from rank 0 alone under torchrun

    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True,
                        help="pre-trained checkpoint: an iter_N directory or a run's checkpoint "
                             "directory (its latest)")
    parser.add_argument("--data", required=True, nargs="+",
                        help="GSM8K train .jsonl (fields question, answer)")
    parser.add_argument("--out", required=True, help="run directory (train.out_dir)")
    parser.add_argument("--epochs", type=float,
                        help="passes over the training records (default 3; excludes an explicit "
                             "train.train_steps)")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_intermixed_args(argv)  # overrides before or after options
    # "--data a.jsonl train.lr=1e-5": argparse gives --data every word up to the next option.
    taken = [d for d in args.data if is_override(d)]
    args.data = [d for d in args.data if d not in taken]
    args.overrides = taken + args.overrides
    if not args.data:
        parser.error("--data: no file given (only section.field=value overrides)")
    from megaloop.cli import quiet_third_party_warnings, refuse_overrides_of
    from megaloop.train import main as train

    quiet_third_party_warnings()
    from megaloop import gsm8k
    from megaloop.config import ConfigError, save_yaml
    from megaloop.data import DataError
    from megaloop.training.checkpoint import CheckpointError

    talk = os.environ.get("RANK", "0") == "0"
    try:
        refuse_overrides_of(args.overrides, set_by_options())
        cfg = gsm8k.finetune_config(args.base, args.data, args.out, args.overrides)
        explicit_steps = any(o.partition("=")[0] == "train.train_steps" for o in args.overrides)
        if explicit_steps and args.epochs is not None:
            raise ConfigError("--epochs and train.train_steps both set the run's length; give one")
        if not explicit_steps:
            epochs = gsm8k.EPOCHS if args.epochs is None else args.epochs
            cfg.train.train_steps, records = gsm8k.steps_for_epochs(cfg, epochs)
            if talk:
                print(f"{epochs:g} epochs of {records} training records at batch "
                      f"{cfg.train.global_batch_size}: {cfg.train.train_steps} steps",
                      file=sys.stderr)
        cfg = gsm8k.resumed_config(cfg, args.base)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def keep(run_config) -> None:
        """Rank 0, as the Trainer writes its config.yaml: the config goes to <out> only once the
        Trainer has set the run up to train, so that a run it refuses leaves <out> as it was (a
        previous finetune.yaml there stays, a new <out> goes again), and a finished run the
        config it trained with."""
        from megaloop.training.collective import is_rank0

        if is_rank0():
            save_yaml(run_config, Path(args.out) / "finetune.yaml")

    # Each process reads its own copy, as each node reads its --config file.
    with tempfile.TemporaryDirectory(prefix="megaloop-finetune-") as staging:
        config_file = Path(staging) / "finetune.yaml"
        save_yaml(cfg, config_file)
        return train(["--config", str(config_file)], then_exit=then_exit, accepted=keep)


if __name__ == "__main__":
    sys.exit(main(then_exit=True))
