"""The main job on a CPU, in minutes: corpus -> tokenizer -> indexed data -> Dense, Full Loop and
AsymLoop through the trainer -> validation CE, answer accuracy by hop count and test-time depth.

    python -m megaloop.quickstart                       # embedded multi-hop task
    python -m megaloop.quickstart --input my.jsonl      # your own .jsonl/.parquet/.txt files

The embedded corpus is generated multi-hop variable binding (megaloop.multihop): programs such as
``d=4;a=7;g=d;c=a;e=g;?e=4`` whose query takes one lookup per binding on its chain. The models
pre-train on it with the ordinary next-token loss over every token, most of which (the names and
digits being bound) are random, so validation cross-entropy says little about the task; the table
therefore scores the answer after ``?x=`` on held-out programs, by hop count, and for the looped
models at test-time depths K (R) = 1..6. Training chains have 1 or 2 bindings, so held-out programs
of 3 to 5 hops are longer than any seen: there a model needs more lookups than it was taught, which
is what more iterations at test time would have to provide.
With ``--input`` the table has the validation CE only. Everything runs in one process with
megatron-core on gloo; nothing is downloaded and nothing outside the output directory is read.
A rerun builds the new quickstart inside the output directory and replaces the previous one only
when it has finished (``StagedOutput``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

from megaloop.cli import Stopped, int_at_least, raise_stopped, signals_handled
from megaloop.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig

VOCAB = 512  # a ceiling: a small corpus gets fewer pieces
# The chains of training programs have 1..MAX_HOPS bindings: in 1000 steps the models learned two
# hops when trained on 1-2, but when trained on 1-3 they stayed near chance beyond one hop.
MAX_HOPS = 2
EVAL_HOPS = range(1, 6)
EVAL_PER_HOP = 200
DOCUMENTS = 6000  # of 4-8 programs each
TEST_DEPTHS = range(1, 7)  # K (AsymLoop) or R (Full Loop) at which the looped models are scored
# Dense at the loops' effective depth J = 8 (equal compute per token) and with their 4 physical
# layers (equal parameters); Full Loop 4 layers x R=2; AsymLoop 2 encoder + 2 decoder x K=3.
RUNS = {
    "dense8": dict(arch="dense", num_layers=8, iterations=1),
    "dense4": dict(arch="dense", num_layers=4, iterations=1),
    "fullloop": dict(arch="fullloop", num_layers=4, iterations=2),
    "asymloop": dict(arch="asymloop", num_layers=4, iterations=3),
}
MATCHED = {"dense8": "compute", "dense4": "params", "fullloop": "both", "asymloop": "both"}


# data.split of every run: 1 document in 20 held out for validation, which a corpus of fewer
# than 20 leaves empty (megatron-core rounds the 5% down to none); the quickstart has no option to
# change it, so such an --input is refused asking for more documents (--documents: by argparse).
SPLIT, MIN_DOCUMENTS = "95,5,0", 20
TEXT_FIELDS = ("text",)  # what a corpus record is read from (a .jsonl field, a parquet column)
INPUT_KINDS = ("--input takes .jsonl records and .parquet rows with a 'text' field, or UTF-8 "
               "plain text (.txt)")


def check_corpus(inputs: list[str]) -> None:
    """Refuses (DataError, naming the file) an ``--input`` whose files the quickstart cannot read
    documents from, by each file's first record as the readers take it (a JSON line with a text
    field, a parquet text column, UTF-8 text), and notes the files a directory holds of other
    types. Before anything is built: given a directory holding a preprocessed dataset, the
    quickstart would otherwise skip its .bin/.idx and train for minutes on whatever its .json
    and .txt files (sidecars, dataset cache descriptions) hold."""
    from megaloop.data import DataError
    from megaloop.data.readers import RecordFilter, expand_inputs, input_notes, iter_chunks, parse_chunk

    record_filter, skipped = RecordFilter(TEXT_FIELDS), []
    files = expand_inputs(inputs, skipped)
    for path in files:
        for chunk in iter_chunks([(path, 0, 1)], record_filter.columns(), max_records=1):
            bad = parse_chunk(chunk, record_filter).bad
            if bad.total:
                raise DataError(f"{bad.examples[0]}; {INPUT_KINDS}")
    for line in input_notes(files, skipped):
        print(f"note: --input: {line}", file=sys.stderr)


def prepare_data(inputs: list[str], data_dir: Path, pieces: list[str]) -> tuple[str, Path]:
    """Trains the tokenizer (``pieces``: user-defined pieces it must keep whole) and writes the
    indexed dataset; returns (dataset prefix, tokenizer model path)."""
    from megaloop.data.preprocess import PreprocessOptions, output_prefix, preprocess, whole_files
    from megaloop.data.readers import BadRecords, DataError, RecordFilter
    from megaloop.data.tokenizer_training import EmptyCorpus, document_lines, train_sentencepiece

    record_filter = RecordFilter(TEXT_FIELDS)
    tokenizer = data_dir / "tokenizer.model"
    try:
        train_sentencepiece(document_lines(inputs, record_filter, None, BadRecords()), tokenizer,
                            vocab_size=VOCAB, hard_vocab_limit=False, special_tokens=pieces)
    except EmptyCorpus:  # its own words name no file: "no text to train the tokenizer on"
        raise DataError(f"--input {' '.join(inputs)}: no text (no records, or only empty or "
                        f"blank texts); the quickstart needs at least {MIN_DOCUMENTS} "
                        "documents") from None
    prefix = str(data_dir / "corpus")
    options = PreprocessOptions("SentencePieceTokenizer", str(tokenizer), record_filter,
                                append_eod=True, workers=0)
    documents = preprocess(whole_files(inputs), prefix, options).docs
    if documents < MIN_DOCUMENTS:
        raise DataError(f"--input {' '.join(inputs)}: {documents} document(s); the quickstart holds 1 in "
                        f"20 out for validation and needs at least {MIN_DOCUMENTS}: give more (a .jsonl "
                        "line, a parquet row, or a blank-line separated paragraph of a .txt is one)")
    return output_prefix(prefix, "text"), tokenizer


def run_config(name: str, prefix: str, tokenizer: Path, out: Path, steps: int,
               eval_depths: list[int]) -> RunConfig:
    from megaloop.data import load_tokenizer, padded_vocab_size

    vocab = padded_vocab_size(load_tokenizer("SentencePieceTokenizer", tokenizer).vocab_size)
    return RunConfig(
        # init_std: megatron-core's 0.02 suits widths in the hundreds; at width 64 it leaves the
        # attention near uniform (in trials no lookup was learned in 1200 steps; with 0.1 one hop
        # was learned in a few hundred). lr 1e-3, the AsymLoop paper's best: with 3e-3 Full Loop
        # learned nothing in 1000 steps.
        model=ModelConfig(hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                          vocab_size=vocab, seq_length=64, init_std=0.1, **RUNS[name]),
        train=TrainConfig(micro_batch_size=16, global_batch_size=16, train_steps=steps, lr=1e-3,
                          out_dir=str(out / name), log_interval=max(steps // 5, 1),
                          eval_iters=4, tensorboard=False,
                          eval_depths=[] if name.startswith("dense") else eval_depths),
        data=DataConfig(path=[prefix], split=SPLIT, tokenizer_model=str(tokenizer),
                        cache_dir=str(out / "data" / "cache")),
        checkpoint=CheckpointConfig(resume=False),
    )


QUICKSTART_OUTPUTS = {"data", "results.json", "curves.png", *RUNS}
# The new quickstart is built in STAGING and moved into --out only when it has finished: first the
# previous one's outputs move into REPLACED, then the directory COMMITTED is made (one atomic
# step), then the new outputs move into --out and REPLACED is removed. Whatever ends the move half
# done (an error, kill -9, a power cut), the next run, under the lock on --out, completes it when
# COMMITTED is there and otherwise moves the previous outputs back: --out then holds one
# quickstart whole, the new or the previous one (``StagedOutput.finish_or_undo_install``).
STAGING = ".quickstart-staging"
REPLACED = ".quickstart-replaced"
COMMITTED = ".quickstart-committed"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def relocated(value, staging: Path, out: Path):
    """``value`` (a config value: dict, list, string...) with each path inside ``staging`` moved
    to the same place inside ``out``."""
    if isinstance(value, dict):
        return {key: relocated(item, staging, out) for key, item in value.items()}
    if isinstance(value, list):
        return [relocated(item, staging, out) for item in value]
    if isinstance(value, str) and Path(value).is_relative_to(staging):
        return str(out / Path(value).relative_to(staging))
    return value


class StagedOutput:
    """``--out`` for one quickstart: ``claim`` checks and locks it, the quickstart writes into
    ``path`` (``<out>/.quickstart-staging``, on the same filesystem, so that moving it is a
    rename), ``install`` replaces the previous quickstart with it, ``close`` removes what is left
    of it and unlocks ``out``."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / STAGING
        self._lock = None
        self._run_locks = []

    def claim(self) -> str | None:
        """Returns why ``out`` cannot be used (a file, a directory holding anything the quickstart
        did not write, one another quickstart is writing to, a model directory a training run is
        using: its resume, say), or locks it and the previous models' run and checkpoint
        directories (so that no training starts in one that the install removes), removes what a
        killed run left there and creates the staging directory."""
        from megaloop.config import ConfigError
        from megaloop.training.run_dir import LOCK_FILE, RunLock

        out = self.out
        if out.exists() and not out.is_dir():
            return f"--out {out}: not a directory"
        entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        own = QUICKSTART_OUTPUTS | {STAGING, REPLACED, COMMITTED, LOCK_FILE}
        foreign = [name for name in entries if name not in own]
        if foreign:
            return (f"--out {out}: holds {', '.join(foreign[:3])}, which the quickstart did not "
                    "write; choose an empty or new directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
            self._lock = RunLock(out, "--out")  # a second quickstart there is refused
            self.finish_or_undo_install()
            for run in (out / name for name in sorted(RUNS)):
                for directory in (run, run / "checkpoints"):
                    if directory.is_dir():
                        self._run_locks.append(RunLock(directory, "--out"))
            _remove(self.path)  # a killed run's unfinished quickstart
            self.path.mkdir()
        except ConfigError as e:
            return str(e)
        except OSError as e:
            return f"--out {out}: {e.strerror or e} ({e.filename})"
        if QUICKSTART_OUTPUTS.intersection(entries):
            print(f"the previous quickstart in {out} is replaced when this one has finished")
        return None

    def install(self) -> None:
        """Replaces the previous quickstart's outputs in ``out`` with the staged ones. The run
        configs saved with the checkpoints name paths inside the staging directory: they are
        rewritten to name ``out``, so that the models resume and export from where they end up.
        Megatron-core's dataset index cache is keyed by the dataset's path, not its contents: made
        for the staging path, it would not be read again, so it is dropped (rebuilt when the data
        is next read from ``out``). The staging directory starts empty in every run, so no run
        reads an index cache made for another corpus."""
        import yaml

        from megaloop.config import dump_yaml
        from megaloop.platform.files import write_text_atomic

        for config in sorted(self.path.rglob("config.yaml")):
            saved = relocated(yaml.safe_load(config.read_text()), self.path, self.out)
            write_text_atomic(config, dump_yaml(saved))
        _remove(self.path / "data" / "cache")
        replaced = self.out / REPLACED
        replaced.mkdir()
        for name in sorted(os.listdir(self.out)):
            if name in QUICKSTART_OUTPUTS:
                os.replace(self.out / name, replaced / name)
        (self.out / COMMITTED).mkdir()
        self.finish_or_undo_install()

    def finish_or_undo_install(self) -> None:
        """Under the lock: completes a move into ``out`` that was committed (the rest of the staged
        outputs move in, the previous ones go), or undoes one that was not (the previous outputs
        move back from REPLACED; the staged ones stay staged). Each step can be cut short and
        taken again: outputs are moved, never copied, and the marker goes last."""
        replaced, committed = self.out / REPLACED, self.out / COMMITTED
        if committed.is_dir():
            for name in sorted(os.listdir(self.path)) if self.path.is_dir() else []:
                os.replace(self.path / name, self.out / name)
            _remove(replaced)
            committed.rmdir()
        elif replaced.is_dir():
            for name in sorted(os.listdir(replaced)):
                os.replace(replaced / name, self.out / name)
            replaced.rmdir()

    def close(self) -> None:
        if self._lock is None:  # not claimed: a staging directory there is another run's
            return
        self.finish_or_undo_install()  # after an install that raised: one quickstart, whole
        _remove(self.path)
        for lock in self._run_locks:  # a lock file it made in a model directory kept goes too
            lock.release(remove_created=True)
        self._run_locks = []
        self._lock.release()
        self._lock = None


def task_accuracy(model, examples, tokenizer, depths) -> dict:
    """Answer accuracy of the trained ``model`` on the held-out ``examples``: overall and by hop
    count, at each test-time depth in ``depths`` (None: the trained depth)."""
    from megaloop.multihop import accuracy_by_hops, score

    model.eval()
    table = {}
    for depth in depths:
        correct = score(model, examples, num_iterations=depth, vocab_size=tokenizer.vocab_size,
                        pad_id=tokenizer.eod)
        table[depth] = {"all": sum(correct) / len(correct),
                        "hops": accuracy_by_hops(examples, correct)}
    return table


def print_task_table(results: dict, hops) -> None:
    print(f"{'model':<9} {'L':>5} {'J':>3} {'params':>7} {'matched':>8} {'val CE':>7} "
          f"{'tok/s':>6} {'acc':>5}  " + " ".join(f"{h}-hop" for h in hops))
    for name, r in results.items():
        acc = r["accuracy"]
        print(f"{name:<9} {r['layers']:>5} {r['depth']:>3} {r['params'] / 1e6:>6.2f}M "
              f"{r['matched']:>8} {r['val_loss']:>7.3f} {r['tokens_per_s']:>6.0f} "
              f"{acc['all']:>5.2f}  " + " ".join(f"{acc['hops'][h]:>5.2f}" for h in hops))
    if not any(r.get("accuracy_by_depth") for r in results.values()):
        return  # no looped model: no test-time depth to vary
    print("answer accuracy at test-time depth K (R for fullloop); chance 0.50")
    print(f"{'model':<9} {'K':>2} {'J':>3} {'acc':>5}  " + " ".join(f"{h}-hop" for h in hops))
    for name, r in results.items():
        for depth, acc in r.get("accuracy_by_depth", {}).items():
            print(f"{name:<9} {depth:>2} {r['depth_at'][depth]:>3} {acc['all']:>5.2f}  "
                  + " ".join(f"{acc['hops'][h]:>5.2f}" for h in hops))


def print_ce_table(results: dict, depths) -> None:
    print(f"{'model':<9} {'L':>5} {'J':>3} {'params':>7} {'val CE':>7} {'val PPL':>8} "
          f"{'tok/s':>6}   val CE at test-time depth K")
    for name, r in results.items():
        at_depth = "  ".join(f"K={k}: {r[f'val_loss_k{k}']:.3f}" for k in depths
                             if f"val_loss_k{k}" in r)
        print(f"{name:<9} {r['layers']:>5} {r['depth']:>3} {r['params'] / 1e6:>6.2f}M "
              f"{r['val_loss']:>7.3f} {r['val_ppl']:>8.2f} {r['tokens_per_s']:>6.0f}   {at_depth}")


def layout(model: ModelConfig) -> str:
    """Physical layers as the table shows them: 8, 4x2 (Full Loop), 2+2x3 (AsymLoop)."""
    if model.arch == "fullloop":
        return f"{model.num_layers}x{model.num_iterations}"
    if model.arch == "asymloop":
        encoder = model.num_encoder_layers
        return f"{encoder}+{model.num_layers - encoder}x{model.num_iterations}"
    return str(model.num_layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", help="corpus files (default: generated multi-hop)")
    parser.add_argument("--out", default="runs/quickstart", help="output directory")
    parser.add_argument("--steps", type=int_at_least(1), default=1000,
                        help="optimizer steps per model")
    parser.add_argument("--documents", type=int_at_least(MIN_DOCUMENTS),
                        help=f"generated corpus size (default {DOCUMENTS}; not with --input)")
    parser.add_argument("--eval-per-hop", type=int_at_least(1), help="held-out programs per hop count "
                        f"(default {EVAL_PER_HOP}; not with --input)")
    parser.add_argument("--models", nargs="+", choices=list(RUNS), default=list(RUNS),
                        help="models to train (default: all)")
    args = parser.parse_args(argv)
    for name in ("documents", "eval_per_hop"):
        if getattr(args, name) is not None and args.input:
            parser.error(f"--{name.replace('_', '-')} applies to the generated task, not to "
                         "--input")
    if args.eval_per_hop is not None:  # checked now, not after a search that cannot succeed
        from megaloop.multihop import program_count

        most = min(program_count(h, MAX_HOPS) for h in EVAL_HOPS)
        if args.eval_per_hop > most:
            parser.error(f"--eval-per-hop {args.eval_per_hop}: the generated task has {most} "
                         f"distinct {min(EVAL_HOPS)}-hop programs, so at most {most} (fewer once "
                         "those seen in training are left out)")
    args.models = list(dict.fromkeys(args.models))

    from megaloop.cli import quiet_third_party_warnings

    quiet_third_party_warnings()
    from megaloop.data import DataError

    out = Path(args.out)
    if args.input:  # checked first: nothing in --out is touched for a mistyped name
        try:
            check_corpus(args.input)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    staged = StagedOutput(out)
    # The staging directory is removed however the run is stopped. A Trainer puts its own
    # SIGTERM and SIGUSR1 handlers in while it trains: it finishes the step and returns
    # ``stopped_by_signal``.
    with signals_handled(STOP_SIGNALS, raise_stopped):
        try:
            problem = staged.claim()
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 2
            code = build(args, staged.path, out)
            if code == 0:  # a stop signal during the renames would leave half of each quickstart
                with signals_handled(STOP_SIGNALS, signal.SIG_IGN):
                    staged.install()
        except Stopped as stop:
            print(f"stopped by signal {stop.signum}; --out {out} is left as it was",
                  file=sys.stderr)
            return 128 + stop.signum
        finally:
            with signals_handled(STOP_SIGNALS, signal.SIG_IGN):
                staged.close()
    if code == 0:
        print(f"curves: {out / 'curves.png'}   table: {out / 'results.json'}")
    return code


def build(args: argparse.Namespace, work: Path, out: Path) -> int:
    """The quickstart itself, written into ``work`` (the staging directory that becomes ``out``);
    an exit status."""
    import dataclasses

    from megaloop import multihop
    from megaloop.config import ConfigError
    from megaloop.data import DataError, load_tokenizer
    from megaloop.models.flops import parameter_count
    from megaloop.training.plots import load_run, plot_runs
    from megaloop.training.trainer import Trainer

    embedded = args.input is None
    if embedded:
        corpus = work / "data" / "multi_hop.jsonl"
        seen = multihop.write_corpus(corpus, args.documents or DOCUMENTS, MAX_HOPS)
        inputs, pieces = [str(corpus)], multihop.task_pieces()
        source = f"the generated task ({out / 'data' / corpus.name})"
    else:
        inputs, pieces = args.input, []
        source = ", ".join(inputs)
    print(f"[1/3] tokenizer (up to {VOCAB} pieces) and indexed dataset from {source}")
    try:
        prefix, tokenizer_path = prepare_data(inputs, work / "data", pieces)
    except (DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer("SentencePieceTokenizer", tokenizer_path)
    if embedded:
        per_hop = args.eval_per_hop or EVAL_PER_HOP
        try:  # under the count main checks, but more than are unseen in training
            held_out = multihop.held_out_programs(1, EVAL_HOPS, per_hop, MAX_HOPS, seen)
        except ValueError as e:
            print(f"error: --eval-per-hop {per_hop}: {e}", file=sys.stderr)
            return 2
        examples = multihop.encode_programs(tokenizer, held_out)
    results = {}
    for index, name in enumerate(args.models, start=1):
        cfg = run_config(name, prefix, tokenizer_path, work, args.steps,
                         [] if embedded else [1, 2, 4, 6])
        model = cfg.model.resolve()
        print(f"[2/3] training {name} ({index}/{len(args.models)}): {layout(model)} layers, "
              f"J={model.effective_depth}, {parameter_count(model) / 1e6:.2f}M parameters, "
              f"{args.steps} steps")
        try:
            trainer = Trainer(cfg)
        except (DataError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        metrics = trainer.train()
        if metrics.get("stopped_by_signal"):  # SIGTERM/SIGUSR1: the user or the scheduler
            signum = int(metrics["stopped_by_signal"])
            print(f"stopped by signal {signum} while training {name} (step {metrics['step']}); "
                  f"--out {out} is left as it was", file=sys.stderr)
            return 128 + signum
        # The training steps' own time, as the trainer logs it: not the set-up (model, data
        # indices) or the evaluations, which would make the short runs look slow.
        step_seconds = sum(record["step_time_s"] for record in load_run(work / name)[0])
        tokens = args.steps * cfg.train.global_batch_size * cfg.model.seq_length
        results[name] = dict(metrics, params=parameter_count(model), layers=layout(model),
                             depth=model.effective_depth, matched=MATCHED[name],
                             tokens_per_s=tokens / step_seconds)
        if embedded:
            looped = model.arch != "dense"
            table = task_accuracy(trainer.model, examples, tokenizer,
                                  TEST_DEPTHS if looped else [None])
            if looped:
                results[name]["accuracy"] = table[model.num_iterations]
                results[name]["accuracy_by_depth"] = table
                results[name]["depth_at"] = {
                    k: dataclasses.replace(model, iterations=k).effective_depth for k in table}
            else:
                results[name]["accuracy"] = table[None]
    print("[3/3] results: validation CE (every token) on held-out documents; tok/s over the "
          "training steps alone (no set-up or evaluation)"
          + (f"; answer accuracy on {per_hop} held-out programs per hop count "
             f"(trained on 1-{MAX_HOPS} hops; chance 0.50)" if embedded else ""))
    if embedded:
        print_task_table(results, EVAL_HOPS)
    else:
        print_ce_table(results, [1, 2, 4, 6])
    plot_runs({name: load_run(work / name) for name in results}, work / "curves.png")
    (work / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
