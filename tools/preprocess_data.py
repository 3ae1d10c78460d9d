"""Tokenize .jsonl(.gz/.zst), parquet or plain text into Megatron .bin/.idx files.

Takes Megatron-LM's tools/preprocess_data.py flags and writes the same files,
``{output_prefix}_{key}_document.bin/.idx``, through megatron-core's IndexedDatasetBuilder:

    python tools/preprocess_data.py --input data/fineweb-edu/ --output-prefix data/fwe \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 8

Differences from Megatron-LM: text is streamed, so memory grows only by the ~80 bytes per document
megatron-core's builder keeps for the index, any number of input files works with
any number of workers, the output bytes do not depend on ``--workers``, bad records are counted and
skipped (``--strict`` aborts), and ``mpiexec -n N`` splits the work across ranks and merges one
output identical to a single-process run. ``--partitions`` is accepted but not needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megaloop.data.readers import DataError, RecordFilter, count_records, expand_inputs
from megaloop.data.tokenizer import TOKENIZER_TYPES, TokenizerError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, nargs="+",
                   help="files, directories or globs (.jsonl[.gz|.zst], .parquet, .txt)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize, one output per key")
    g.add_argument("--min-int-score", type=int, help="FineWeb-Edu: keep records with int_score >= this")
    g.add_argument("--min-score", type=float, help="FineWeb-Edu: keep records with score >= this")
    g.add_argument("--max-docs", type=int, help="stop after this many documents (in input order)")
    g.add_argument("--strict", action="store_true", help="abort on the first bad record instead of skipping it")
    g.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--keep-sequential-samples", action="store_true", help="accepted; output is always in input order")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or HF tokenizer.json (or its directory)")
    g.add_argument("--append-eod", action="store_true", help="end each document with the tokenizer's EOD id")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, required=True, help="tokenizer processes (per MPI rank)")
    g.add_argument("--partitions", type=int, default=1, help="accepted for compatibility; streaming makes it unnecessary")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between log lines when not on a terminal")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences is not supported: megaloop trains on whole documents")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.max_docs is not None and args.max_docs < 1:
        parser.error("--max-docs must be at least 1")
    return args


def _options(args: argparse.Namespace):
    from megaloop.data.preprocess import PreprocessOptions

    return PreprocessOptions(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        record_filter=RecordFilter(tuple(args.json_keys), args.min_int_score, args.min_score),
        append_eod=args.append_eod,
        workers=args.workers,
        max_docs=args.max_docs,
        strict=args.strict,
    )


class ProgressReporter:
    """A rich progress bar on a terminal; Megatron-LM-style log lines every N docs otherwise."""

    def __init__(self, files: list[str], log_interval: int, label: str = ""):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.log_interval, self.next_log, self.label = log_interval, log_interval, label
        plain = all(f.lower().endswith((".jsonl", ".json", ".txt")) for f in files)
        # Only uncompressed inputs have a known total in the bytes we count.
        self.total = sum(os.path.getsize(f) for f in files) if plain else None
        self.progress = None
        if self.console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn(f"{label}tokenizing"), BarColumn(), TextColumn("{task.fields[rates]}"),
                TimeElapsedColumn(), console=self.console,
            )
            self.task = self.progress.add_task("", total=self.total, rates="")

    def __enter__(self):
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()

    def __call__(self, stats) -> None:
        if self.progress:
            rates = f"{stats.docs:,} docs | {stats.rates()}"
            self.progress.update(self.task, completed=stats.bytes, rates=rates)
        elif stats.docs >= self.next_log:
            self.console.print(f"{self.label}processed {stats.docs:,} documents ({stats.rates()})", highlight=False, soft_wrap=True)
            self.next_log = (stats.docs // self.log_interval + 1) * self.log_interval


def run_single(args: argparse.Namespace) -> int:
    from megaloop.data.preprocess import check_tokenizer, output_prefix, preprocess, whole_files

    options = _options(args)
    check_tokenizer(options)  # before any reading, as the user's mistake is likeliest here
    ranges = whole_files(args.input)
    with ProgressReporter([r[0] for r in ranges], args.log_interval) as reporter:
        stats = preprocess(ranges, args.output_prefix, options, reporter)
    _report(stats, [output_prefix(args.output_prefix, k) for k in args.json_keys])
    return 0


def run_mpi(args: argparse.Namespace, comm) -> int:
    """Each rank tokenizes a contiguous slice of the global record order; rank 0 merges them."""
    from megaloop.data.indexed import merge_indexed, validate_indexed
    from megaloop.data.preprocess import check_tokenizer, output_prefix, preprocess, shard_ranges

    rank, world = comm.Get_rank(), comm.Get_size()
    options = _options(args)
    check_tokenizer(options)
    files = expand_inputs(args.input)
    # Ranks count disjoint subsets of the files, then all learn every count.
    mine = {i: count_records(files[i]) for i in range(rank, len(files), world)}
    counts = {i: n for part in comm.allgather(mine) for i, n in part.items()}
    ranges = shard_ranges([(f, counts[i]) for i, f in enumerate(files)], world, rank)
    shard = f"{args.output_prefix}.shard{rank:05d}-of-{world:05d}"
    with ProgressReporter([r[0] for r in ranges], args.log_interval, label=f"[rank {rank}] ") as reporter:
        stats = preprocess(ranges, shard, options, reporter)
    all_stats = comm.gather(stats, root=0)
    if rank == 0:
        total = all_stats[0]
        for other in all_stats[1:]:
            total.merge(other)
        shards = [f"{args.output_prefix}.shard{r:05d}-of-{world:05d}" for r in range(world)]
        total.tokens = 0  # the ranks' sum counts documents that --max-docs cuts in the merge
        for key in args.json_keys:
            parts = [output_prefix(s, key) for s in shards]
            merged = output_prefix(args.output_prefix, key)
            total.docs = merge_indexed(parts, merged, args.max_docs)
            total.tokens += validate_indexed(merged).num_tokens
            for s in shards:
                for suffix in (".bin", ".idx"):
                    os.remove(output_prefix(s, key) + suffix)
        _report(total, [output_prefix(args.output_prefix, k) for k in args.json_keys])
    comm.Barrier()
    return 0


def _report(stats, prefixes: list[str]) -> None:
    from rich.console import Console

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"done: {stats.docs:,} documents, {stats.tokens:,} tokens in {stats.seconds:.1f}s ({stats.rates()})")
    if stats.filtered:
        console.print(f"filtered out {stats.filtered:,} records below the score threshold")
    if stats.bad.total:
        console.print(f"warning: {stats.bad.summary()}; first ones:")
        for example in stats.bad.examples:
            console.print(f"  {example}")
    for prefix in prefixes:
        console.print(f"wrote {prefix}.bin / .idx")


def _mpi_world_size() -> int:
    # Set by mpiexec (MPICH/Hydra: PMI_SIZE; Open MPI: OMPI_COMM_WORLD_SIZE). Checking the
    # environment first keeps plain runs from initialising MPI at all.
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    comm = None
    try:
        if _mpi_world_size() > 1:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            code = run_mpi(args, comm)
        else:
            code = run_single(args)
    except (DataError, TokenizerError) as err:
        print(f"error: {err}", file=sys.stderr)
        if comm is not None and comm.Get_size() > 1:
            comm.Abort(2)  # the other ranks would wait forever in a collective
        return 2
    except KeyboardInterrupt:
        print("interrupted: partial output removed", file=sys.stderr)
        return 130
    print(f"total wall time {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
