"""Tokenize .jsonl(.gz/.zst), parquet or plain text into Megatron .bin/.idx files.

Takes Megatron-LM's tools/preprocess_data.py flags and writes the same files,
``{output_prefix}_{key}_document.bin/.idx``, through megatron-core's IndexedDatasetBuilder, and
beside them ``.tokenizer.json``, which training checks its tokenizer settings against:

    python tools/preprocess_data.py --input data/fineweb-edu/ --output-prefix data/fwe \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 8

For every JSON-lines input Megatron-LM (core_v0.16.1) accepts, the bytes are its bytes: texts or
lists of sentences, empty and blank texts, --legacy-tokenizer. Differences: text is streamed, so
memory grows only by the ~80 bytes per document megatron-core's builder keeps for the index, any
number of input files works with any number of workers, the output bytes do not depend on
``--workers``, bad records are counted and skipped (``--strict`` aborts), an input without a usable
document is an error, outputs an earlier run left are refused unless ``--overwrite``, and
``mpiexec -n N`` splits the work across ranks and merges one output identical to a single-process
run. ``--partitions`` is accepted but not needed (a note says so).
Exit status: 0 done, 2 bad input or settings, 1 a worker process died, 130 Ctrl-C, 143 SIGTERM; on
any failure no output is left behind, and outputs replaced with ``--overwrite`` stay until the new
ones are written (an interruption as they are renamed in leaves a .bin without .idx, which readers
refuse, never the new .bin read through the old .idx).
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import signal
import sys
import time

from megaloop.cli import (ArgumentParser, Stopped, int_at_least, json_keys_refusal, raise_stopped,
                          signals_handled)
from megaloop.data.readers import (
    DataError,
    RecordFilter,
    count_records,
    expand_inputs,
    input_notes,
)
from megaloop.data.tokenizer import LEGACY_CHANGES, TOKENIZER_TYPES, TokenizerError, check_tokenizer_metadata


class _RanksParser(ArgumentParser):
    """megaloop's: a usage error, alike on every rank, comes from rank 0 alone; the ranks are
    mpiexec's (or srun's, refused later unless they are MPI's), as ``_mpi_comm`` finds them."""

    launchers = ("mpi", "slurm")


def build_parser() -> argparse.ArgumentParser:
    p = _RanksParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, nargs="+",
                   help="files, directories or globs (.jsonl[.gz|.zst], .parquet, .txt: one document per "
                        "blank-line separated paragraph)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize, one output per key")
    g.add_argument("--min-int-score", type=int, help="FineWeb-Edu: keep records with int_score >= this")
    g.add_argument("--min-score", type=float, help="FineWeb-Edu: keep records with score >= this")
    g.add_argument("--max-docs", type=int_at_least(1), help="stop after this many documents (in input order)")
    g.add_argument("--strict", action="store_true", help="abort on the first bad record instead of skipping it")
    g.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--keep-newlines", action="store_true",
                   help="accepted; as in Megatron-LM it acts only with --split-sentences (texts keep their newlines)")
    g.add_argument("--keep-sequential-samples", action="store_true", help="accepted; output is always in input order")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or HF tokenizer.json (or its directory)")
    g.add_argument("--append-eod", action="store_true", help="end each document with the tokenizer's EOD id")
    g.add_argument("--legacy-tokenizer", action="store_true",
                   help="encode as Megatron-LM's legacy tokenizers do (SentencePieceTokenizer: special-token "
                        "strings and an added <EOD> id; Llama2Tokenizer: bos first; HF: special tokens)")
    g.add_argument("--tokenizer-metadata", help="Megatron-LM tokenizer metadata JSON; checked to agree with "
                                                "--tokenizer-type (it changes no encoding megaloop supports)")
    g.add_argument("--vocab-size", type=int,
                   help="accepted; as in Megatron-LM it sizes only TikTokenizer/NullTokenizer, not these types")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--overwrite", action="store_true",
                   help="replace outputs an earlier run left under --output-prefix (refused otherwise)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int_at_least(1), required=True, help="tokenizer processes (per MPI rank)")
    g.add_argument("--partitions", type=int, default=1, help="accepted for compatibility; streaming makes it unnecessary")
    g.add_argument("--log-interval", type=int_at_least(1), default=1000,
                   help="documents between log lines when not on a terminal")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences is not supported: megaloop trains on whole documents")
    if refusal := json_keys_refusal(args.json_keys):
        parser.error(refusal)
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
        legacy_tokenizer=args.legacy_tokenizer,
    )


def setting_notes(args: argparse.Namespace) -> list[str]:
    """A line for each Megatron-LM flag given that changes nothing here, as it changes nothing there."""
    notes = []
    if args.keep_newlines:
        notes.append("--keep-newlines changes nothing: Megatron-LM applies it only with --split-sentences; "
                     "texts keep their newlines")
    if args.vocab_size is not None:
        notes.append(f"--vocab-size {args.vocab_size} changes nothing: Megatron-LM uses it for TikTokenizer and "
                     f"NullTokenizer only; {args.tokenizer_type} has the model's own vocab")
    if args.partitions != 1:
        notes.append(f"--partitions {args.partitions} changes nothing: the input is streamed, so it "
                     "needs no partitions to bound memory")
    if args.legacy_tokenizer and args.tokenizer_type not in LEGACY_CHANGES:
        notes.append(f"--legacy-tokenizer changes nothing with {args.tokenizer_type}: Megatron-LM's legacy "
                     "and new tokenizers encode it alike")
    if args.tokenizer_metadata and args.legacy_tokenizer:
        notes.append("--tokenizer-metadata changes nothing with --legacy-tokenizer (Megatron-LM reads it "
                     "only for its new tokenizers)")
    return notes


def leftover_notes(prefix: str, keys: list[str]) -> list[str]:
    """A line for each temporary .bin/.idx of these outputs (or of their MPI shards) that a killed
    run (SIGKILL: the out-of-memory killer, a scheduler's last resort) left: nothing else removes
    them, and a .bin may be as large as the dataset. An output that is a symbolic link has its
    temporaries beside the file it names."""
    from megaloop.data.indexed import partial_leftovers
    from megaloop.data.preprocess import output_prefix

    shards = glob.escape(prefix) + ".shard*-of-*"  # shard_prefix's names
    leftovers = sorted({path for key in keys for path in partial_leftovers(output_prefix(prefix, key))}
                       | {path for key in keys
                          for path in glob.glob(f"{shards}_{glob.escape(key)}_document.partial-*")})
    return [f"{path} ({os.path.getsize(path) / 1e9:.2f} GB) is left from a run that was killed; "
            "remove it unless a run is writing it now" for path in leftovers if os.path.isfile(path)]


def check_output_prefix(prefix: str) -> None:
    """Fail before any work if the output directory cannot be made or written to, or if the
    prefix names only a directory (the outputs would be named ``_text_document.bin``)."""
    import tempfile

    if os.path.basename(prefix) in ("", ".", ".."):
        raise DataError(f"--output-prefix {prefix}: names a directory, not the start of the "
                        "outputs' names ({prefix}_{key}_document.bin/.idx); add a name, such as "
                        f"{os.path.join(prefix, 'fwe')}")
    directory = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".preprocess-write-check-"):
            pass
    except OSError as err:
        raise DataError(f"{prefix}: cannot write the output in {directory} ({err.strerror or err})")


def refuse_existing_outputs(prefix: str, keys: list[str]) -> None:
    """Without --overwrite, outputs already under ``prefix`` are refused: a rerun with other
    settings (another tokenizer or input, --max-docs) would replace, without a word, the data that
    training configs name by this prefix. Megatron-LM replaces them. With --overwrite they stay
    until the new ones are complete."""
    from megaloop.data.preprocess import output_prefix, sidecar_path

    found = [path for key in keys for stem in [output_prefix(prefix, key)]
             for path in (stem + ".bin", stem + ".idx", sidecar_path(stem)) if os.path.lexists(path)]
    if found:
        more, them = (f" (and {len(found) - 1} more of its outputs) exist", "them") if len(found) > 1 else (
            " exists", "it")
        raise DataError(f"--output-prefix {prefix}: {found[0]}{more}; pass --overwrite to replace {them}, or "
                        "choose another prefix")


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


def _print(line: str) -> None:
    print(line, file=sys.stderr)


def run_single(args: argparse.Namespace, files: list[str]) -> None:
    from megaloop.data.preprocess import output_prefix, preprocess

    with ProgressReporter(files, args.log_interval) as reporter:
        stats = preprocess([(f, 0, None) for f in files], args.output_prefix, _options(args), reporter)
    _report(stats, [output_prefix(args.output_prefix, k) for k in args.json_keys])


def shard_prefix(prefix: str, rank: int, world: int) -> str:
    return f"{prefix}.shard{rank:05d}-of-{world:05d}"


def remove_shards(prefix: str, world: int, keys: list[str]) -> None:
    """Every rank's shard files, committed or partial: a failed run leaves no dataset that looks valid."""
    from megaloop.data.indexed import partial_leftovers
    from megaloop.data.preprocess import output_prefix, sidecar_path
    from megaloop.platform.files import atomic_write_leftovers

    for rank in range(world):
        for key in keys:
            shard = output_prefix(shard_prefix(prefix, rank, world), key)
            base, sidecar = glob.escape(shard), sidecar_path(shard)
            for path in (glob.glob(base + ".bin") + glob.glob(base + ".idx") + partial_leftovers(shard)
                         + glob.glob(glob.escape(sidecar)) + atomic_write_leftovers(sidecar)):
                try:
                    os.remove(path)
                except FileNotFoundError:  # its rank removed it first
                    pass


def run_mpi(args: argparse.Namespace, files: list[str], comm) -> None:
    """Each rank tokenizes a contiguous slice of the global record order; rank 0 merges them."""
    from megaloop.data.preprocess import WorkerDied, preprocess, shard_ranges

    rank, world = comm.Get_rank(), comm.Get_size()
    # Ranks count disjoint subsets of the files, then all learn every count.
    mine = _agreed(comm, lambda: {i: count_records(files[i]) for i in range(rank, len(files), world)})
    counts = {i: n for part in comm.allgather(mine) for i, n in part.items()}
    ranges = shard_ranges([(f, counts[i]) for i, f in enumerate(files)], world, rank)
    stats = problem = None
    try:  # this rank's own part: its error names it
        shard = shard_prefix(args.output_prefix, rank, world)
        with ProgressReporter([r[0] for r in ranges], args.log_interval, label=f"[rank {rank}] ") as reporter:
            stats = preprocess(ranges, shard, _options(args), reporter, allow_empty=True)
    except (DataError, TokenizerError, WorkerDied) as err:
        problem = (1 if isinstance(err, WorkerDied) else 2, f"error: rank {rank}: {err}")
    # A rank's failure ends every rank together, each failed rank saying its own line, rather
    # than by MPI_Abort, with which mpiexec could end the job before it forwarded that line.
    problems = comm.allgather(problem)
    if any(p is not None for p in problems):
        if rank == 0:  # the others' shards, committed already
            remove_shards(args.output_prefix, world, args.json_keys)
        code = next(p[0] for p in problems if p is not None)
        raise CheckFailedOnSomeRank(None if problem is None else problem[1], code)
    all_stats = comm.gather(stats, root=0)
    failed = None
    if rank == 0:
        try:
            _merge(args, files, all_stats, world)
        except DataError as err:
            remove_shards(args.output_prefix, world, args.json_keys)
            failed = f"error: {err}"
    # Every rank learns the merge's outcome and a failed one ends them together, rank 0 saying
    # why: with MPI_Abort, mpiexec could end the job before it forwarded rank 0's line (under
    # load the run exited 2 having said nothing).
    failed = comm.bcast(failed, root=0)
    if failed is not None:
        raise CheckFailedOnSomeRank(failed if rank == 0 else None)


def _merge(args: argparse.Namespace, files: list[str], all_stats: list, world: int) -> None:
    """Rank 0's part of an MPI run: the ranks' shards (``all_stats``: their counts) merged into
    the outputs, checked as a single process checks its documents, and removed."""
    from megaloop.data.indexed import merge_indexed
    from megaloop.data.preprocess import check_usable, output_prefix, read_sidecar, remove_sidecar, write_sidecar

    shards = {key: [output_prefix(shard_prefix(args.output_prefix, r, world), key) for r in range(world)]
              for key in args.json_keys}
    total = merged_stats(all_stats, shards, args.max_docs)
    check_usable(total, args.json_keys, files)  # as a single process checks: the documents kept
    for key, parts in shards.items():
        merged = output_prefix(args.output_prefix, key)
        # An output replaced (--overwrite) keeps its sidecar until the merge is written: one
        # that fails (a full disk) leaves the old output whole.
        merge_indexed(parts, merged, args.max_docs, before_commit=functools.partial(remove_sidecar, merged))
        # Every shard's sidecar describes the same tokenizer; the counts are the merge's.
        write_sidecar(merged, {**read_sidecar(parts[0]), "documents": total.docs,
                               "tokens": total.key_tokens[key]})
    remove_shards(args.output_prefix, world, args.json_keys)
    _report(total, [output_prefix(args.output_prefix, k) for k in args.json_keys])


def merged_stats(all_stats: list, shards: dict[str, list[str]], max_docs: int | None):
    """The ranks' stats summed, with the documents, tokens and empty documents of the first
    ``max_docs`` documents (each rank stops at ``max_docs`` of its own; the merge keeps the
    first of all): what a single process counts and checks. ``shards``: each key's shard
    prefixes, in rank order."""
    from megaloop.data.indexed import document_tokens, validate_indexed

    total = all_stats[0]
    for other in all_stats[1:]:
        total.merge(other)
    if max_docs is None or total.docs <= max_docs:
        return total
    total.docs, total.empty = max_docs, 0
    for key, parts in shards.items():
        left, total.key_tokens[key] = max_docs, 0
        for part, stats in zip(parts, all_stats):
            tokens = document_tokens(validate_indexed(part), min(left, stats.docs))
            total.key_tokens[key] += int(tokens.sum())
            total.empty += int((tokens == 0).sum())
            left -= len(tokens)
    total.tokens = sum(total.key_tokens.values())
    return total


def _report(stats, prefixes: list[str]) -> None:
    from rich.console import Console

    from megaloop.data.preprocess import SIDECAR_SUFFIX

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"done: {stats.docs:,} documents, {stats.tokens:,} tokens in {stats.seconds:.2f}s, "
                  f"{stats.cpu_seconds:.2f} CPU s ({stats.rates()})")
    if stats.filtered:
        console.print(f"filtered out {stats.filtered:,} records below the score threshold")
    if stats.empty:
        console.print(f"note: {stats.empty:,} documents have no tokens (empty texts); written as empty "
                      f"documents, as Megatron-LM does")
    if stats.bad.total:
        console.print(f"warning: {stats.bad.summary()}; first ones:")
        for example in stats.bad.examples:
            console.print(f"  {example}")
    for prefix in prefixes:
        console.print(f"wrote {prefix}.bin / .idx / {SIDECAR_SUFFIX}")


def _mpi_comm():
    """MPI.COMM_WORLD under mpiexec with more than one rank, else None.

    Set by mpiexec (MPICH/Hydra: PMI_SIZE; Open MPI: OMPI_COMM_WORLD_SIZE). Checking the
    environment first keeps plain runs from initialising MPI at all.
    """
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 1:
            from mpi4py import MPI

            return MPI.COMM_WORLD
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if tasks.isdigit() and int(tasks) > 1:  # srun's tasks, not MPI ranks
        raise DataError(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) that are not MPI ranks: "
                        "each would tokenize the whole input into the same output; run one task, "
                        "or mpiexec -n N as slurm/preprocess.sh does")
    return None


def run(args: argparse.Namespace, comm) -> None:
    lead = comm is None or comm.Get_rank() == 0
    files, skipped = _agreed(comm, lambda: _checked_inputs(args))
    if lead:
        notes = setting_notes(args) + input_notes(files, skipped)
        # Before run_mpi's first collective: no other rank of this run has a partial file yet.
        for line in notes + leftover_notes(args.output_prefix, args.json_keys):
            _print(f"note: {line}")
    if comm is None:
        run_single(args, files)
    else:
        run_mpi(args, files, comm)


def _checked_inputs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The input files and those left out of them, once the settings and the output location
    are checked first: the user's mistake is likeliest there, and cheap to find."""
    from megaloop.data.preprocess import check_tokenizer

    check_output_prefix(args.output_prefix)
    if not args.overwrite:
        refuse_existing_outputs(args.output_prefix, args.json_keys)
    if args.tokenizer_metadata and not args.legacy_tokenizer:
        check_tokenizer_metadata(args.tokenizer_metadata, args.tokenizer_type)
    check_tokenizer(_options(args))
    skipped: list[str] = []
    return expand_inputs(args.input, skipped), skipped


class CheckFailedOnSomeRank(Exception):
    """Raised on every MPI rank once a check before any collective failed on one or more of
    them (``_agreed``), a rank's tokenizing failed, or rank 0's merge failed (``run_mpi``): none
    is left waiting, so each exits with status ``code`` without MPI_Abort. ``line``: what this
    rank prints (None: another rank says it). Not megaloop.cli's ``decided_on_every_rank`` mark,
    whose error is the same on every rank and said by rank 0: here ranks that failed otherwise
    each say their own line."""

    def __init__(self, line: str | None, code: int = 2):
        super().__init__(line)
        self.line, self.code = line, code


def _agreed(comm, check):
    """``check()``, whose DataError or TokenizerError on any MPI rank fails every rank
    (CheckFailedOnSomeRank): an error every rank found alike is said by rank 0 alone, and a rank's
    own (a file its node does not see) by that rank, after ``rank N: ``. Before, every rank
    printed its error and called MPI_Abort, and as many ranks said the same line as reached it
    before the first abort ended them (2 to 4 of 4 ranks)."""
    if comm is None:
        return check()
    result = problem = None
    try:
        result = check()
    except (DataError, TokenizerError) as err:
        problem = str(err)
    every = comm.allgather(problem)
    if not any(p is not None for p in every):
        return result
    rank = comm.Get_rank()
    if all(p == problem for p in every):
        raise CheckFailedOnSomeRank(f"error: {problem}" if rank == 0 else None)
    raise CheckFailedOnSomeRank(None if problem is None else f"error: rank {rank}: {problem}")


def main(argv: list[str] | None = None) -> int:
    # The handler comes first, so a SIGTERM (SLURM, ``timeout``, ``docker stop``) at any point
    # unwinds like Ctrl-C, removing partial output, and says so.
    with signals_handled((signal.SIGTERM,), raise_stopped):
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from megaloop.data.preprocess import WorkerDied

    args = parse_args(argv)
    started = time.perf_counter()
    comm = None
    try:
        comm = _mpi_comm()
        run(args, comm)
    except CheckFailedOnSomeRank as failed:
        if failed.line is not None:
            _print(failed.line)
        # The ranks exit together: mpiexec ends every rank at the first failed exit, and one
        # that left the line to another could end that one before it is said.
        comm.Barrier()
        return failed.code
    except (DataError, TokenizerError) as err:
        return _fail(2, f"error: {err}", args, comm)
    except WorkerDied as err:
        return _fail(1, f"error: {err}", args, comm)
    except KeyboardInterrupt:
        return _fail(130, "interrupted: partial output removed", args, comm)
    except Stopped:  # (SIGTERM, the one signal handled)
        return _fail(143, "terminated by SIGTERM: partial output removed", args, comm)
    _print(f"total wall time {time.perf_counter() - started:.1f}s")
    return 0


def _fail(code: int, message: str, args: argparse.Namespace, comm) -> int:
    _print(message)
    if comm is not None:
        # Another rank may have committed its shard already, or may sit in a collective forever.
        remove_shards(args.output_prefix, comm.Get_size(), args.json_keys)
        comm.Abort(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
