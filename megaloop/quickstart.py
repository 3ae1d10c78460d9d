"""The main job on a CPU, in minutes: corpus -> tokenizer -> indexed data -> Dense, Full Loop and
AsymLoop at matched effective depth -> evaluation table and curves.

    python -m megaloop.quickstart                       # embedded multi-hop corpus
    python -m megaloop.quickstart --input my.jsonl      # your own .jsonl/.parquet/.txt files

The embedded corpus is generated: short programs of interleaved variable-binding chains and a query,
e.g. ``k = 4 ; p = 9 ; q = k ; b = q ; r = p ; ? b = 4``. Answering takes as many lookups as the
chain has hops (pointer chasing past distractor chains), the kind of depth looped models are built
for. Names and chain-head values are random, so the cross-entropy has a floor well above zero (about
1.5 nats/token here); a few hundred CPU steps learn the program syntax and the references, not yet
reliable pointer chasing, so the three models land close together. Everything runs in one
process with megatron-core on gloo; nothing is downloaded and nothing outside the output directory
is read.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

from megaloop.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig

VOCAB = 512  # a ceiling: a small corpus gets fewer pieces
# Three models at effective depth J = 8 with the same width.
RUNS = {
    "dense": dict(arch="dense", num_layers=8, iterations=1),
    "fullloop": dict(arch="fullloop", num_layers=4, iterations=2),
    "asymloop": dict(arch="asymloop", num_layers=4, iterations=3),
}


def multi_hop_program(rng: random.Random) -> str:
    """Interleaved chains of variable bindings and a query on one chain's last name, e.g.
    ``k = 4 ; p = 9 ; q = k ; b = q ; r = p ; ? b = 4``: the answer is found only by following
    b -> q -> k through the program, past the other chains' values (the distractors)."""
    chains = rng.randint(2, 3)
    names = iter(rng.sample(string.ascii_lowercase, 5 * chains))
    values = rng.sample(range(10), chains)
    statements = []  # per chain, in order
    for value in values:
        chain = [next(names)]
        lines = [f"{chain[0]} = {value}"]
        for _ in range(rng.randint(1, 4)):
            chain.append(next(names))
            lines.append(f"{chain[-1]} = {chain[-2]}")
        statements.append((lines, chain[-1], value))
    order = [c for c, (lines, _, _) in enumerate(statements) for _ in lines]
    rng.shuffle(order)  # interleave the chains, keeping each chain's own order
    cursors = [0] * chains
    program = []
    for c in order:
        program.append(statements[c][0][cursors[c]])
        cursors[c] += 1
    _, last, value = statements[rng.randrange(chains)]
    return " ; ".join(program) + f" ; ? {last} = {value}"


def write_corpus(path: Path, documents: int, seed: int = 0) -> Path:
    """JSONL of documents, each a few programs, one per line; written atomically."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for i in range(documents):
            text = "\n".join(multi_hop_program(rng) for _ in range(rng.randint(4, 8)))
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    tmp.replace(path)
    return path


def prepare_data(inputs: list[str], data_dir: Path) -> tuple[str, Path]:
    """Trains the tokenizer and writes the indexed dataset; returns (dataset prefix, model path)."""
    from megaloop.data.preprocess import PreprocessOptions, output_prefix, preprocess, whole_files
    from megaloop.data.readers import BadRecords, RecordFilter
    from megaloop.data.tokenizer_training import document_lines, train_sentencepiece

    record_filter = RecordFilter(("text",))
    tokenizer = data_dir / "tokenizer.model"
    train_sentencepiece(document_lines(inputs, record_filter, None, BadRecords()), tokenizer,
                        vocab_size=VOCAB, hard_vocab_limit=False)
    prefix = str(data_dir / "corpus")
    options = PreprocessOptions("SentencePieceTokenizer", str(tokenizer), record_filter,
                                append_eod=True, workers=0)
    preprocess(whole_files(inputs), prefix, options)
    return output_prefix(prefix, "text"), tokenizer


def run_config(name: str, prefix: str, tokenizer: Path, out: Path, steps: int) -> RunConfig:
    from megaloop.data import load_tokenizer, padded_vocab_size

    vocab = padded_vocab_size(load_tokenizer("SentencePieceTokenizer", tokenizer).vocab_size)
    return RunConfig(
        model=ModelConfig(hidden_size=128, ffn_hidden_size=344, num_attention_heads=4,
                          vocab_size=vocab, seq_length=128, **RUNS[name]),
        train=TrainConfig(micro_batch_size=8, global_batch_size=16, train_steps=steps, lr=3e-3,
                          out_dir=str(out / name), log_interval=max(steps // 5, 1),
                          eval_iters=4, tensorboard=False,
                          eval_depths=[] if name == "dense" else [1, 2, 4, 6]),
        data=DataConfig(path=[prefix], split="95,5,0", tokenizer_model=str(tokenizer),
                        cache_dir=str(out / "data" / "cache")),
        checkpoint=CheckpointConfig(resume=False),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", help="corpus files (default: generated multi-hop)")
    parser.add_argument("--out", default="runs/quickstart", help="output directory")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per model")
    parser.add_argument("--documents", type=int, default=3000, help="generated corpus size")
    args = parser.parse_args(argv)

    from megaloop.train import _quiet_third_party_warnings

    _quiet_third_party_warnings()
    from megaloop.models.flops import parameter_count
    from megaloop.training.plots import load_run, plot_runs
    from megaloop.training.trainer import Trainer

    from megaloop.config import ConfigError
    from megaloop.data import DataError

    out = Path(args.out)
    inputs = args.input or [str(write_corpus(out / "data" / "multi_hop.jsonl", args.documents))]
    print(f"[1/3] tokenizer (up to {VOCAB} pieces) and indexed dataset from {', '.join(inputs)}")
    try:
        prefix, tokenizer = prepare_data(inputs, out / "data")
    except (DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = {}
    for index, name in enumerate(RUNS, start=1):
        cfg = run_config(name, prefix, tokenizer, out, args.steps)
        print(f"[2/3] training {name} ({index}/{len(RUNS)}): J={cfg.model.effective_depth}, "
              f"{parameter_count(cfg.model) / 1e6:.2f}M parameters, {args.steps} steps")
        start = time.perf_counter()
        metrics = Trainer(cfg).train()
        elapsed = time.perf_counter() - start
        tokens = args.steps * cfg.train.global_batch_size * cfg.model.seq_length
        results[name] = dict(metrics, params=parameter_count(cfg.model),
                             depth=cfg.model.effective_depth, tokens_per_s=tokens / elapsed)
    print("[3/3] results (validation on held-out documents)")
    print(f"{'model':<10} {'J':>3} {'params':>8} {'val CE':>8} {'val PPL':>8} {'tokens/s':>9}   "
          "val CE at test-time depth K")
    for name, r in results.items():
        depths = "  ".join(f"K={k}: {r[f'val_loss_k{k}']:.3f}" for k in (1, 2, 4, 6)
                           if f"val_loss_k{k}" in r)
        print(f"{name:<10} {r['depth']:>3} {r['params'] / 1e6:>7.2f}M {r['val_loss']:>8.3f} "
              f"{r['val_ppl']:>8.2f} {r['tokens_per_s']:>9.0f}   {depths}")
    plot_runs({name: load_run(out / name) for name in RUNS}, out / "curves.png")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"curves: {out / 'curves.png'}   table: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
