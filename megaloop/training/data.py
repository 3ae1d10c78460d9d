"""Training and validation batches from megatron-core GPT datasets (``data.format=indexed``) or
prompt/solution records for fine-tuning (``data.format=sft``, megaloop.data.sft).

Sample order is a function of the dataset seed and of ``consumed_samples`` only, so a resumed run
reads exactly the batches an uninterrupted run would, and the global batch is the same set of samples
whatever the data-parallel size: step s uses samples [s*G, (s+1)*G), and micro-batch m of data-
parallel rank r takes the ``micro_batch_size`` samples at s*G + (m*dp + r)*micro_batch_size.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path

import numpy
import torch

from megaloop.cli import decided_on_every_rank, is_decided_on_every_rank
from megaloop.config import ConfigError, DataConfig, RunConfig
from megaloop.data import (DataError, DatasetTokenizer, TokenizerError, build_gpt_datasets,
                           load_tokenizer, parse_blend, validate_indexed)
from megaloop.data.indexed import (IndexedSummary, bin_path, bin_sample_md5, document_last_tokens,
                                   idx_path)
from megaloop.data.preprocess import file_sha256, read_sidecar, sidecar_path
from megaloop.data.readers import expand_inputs
from megaloop.data.tokenizer import tokenizer_file
from megaloop.platform.files import write_text_atomic
from megaloop.training.collective import each_rank_agrees, is_rank0, rank0_decides

log = logging.getLogger("megaloop.train")
_SCAN_CHUNK = 1 << 26  # tokens per pass of the max-id scan: bounded resident memory


def text_tokenizer(cfg: RunConfig):
    """The tokenizer ``data.tokenizer_model`` names, encoding as ``data.legacy_tokenizer`` says (a
    ConfigError naming it when unusable)."""
    data = cfg.data
    try:
        return load_tokenizer(data.tokenizer_type, data.tokenizer_model,
                              legacy=data.legacy_tokenizer)
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer_model={data.tokenizer_model!r}: {e}") from None


def dataset_tokenizer(cfg: RunConfig, text=None) -> DatasetTokenizer:
    """From ``text`` (``text_tokenizer(cfg)``, loaded here when not given) or ``data.eod_id``."""
    data, model = cfg.data, cfg.model
    if data.tokenizer_model is not None:
        tokenizer = DatasetTokenizer.from_text_tokenizer(text or text_tokenizer(cfg))
    elif not 0 <= data.eod_id < model.vocab_size:  # no token could be it: masks and resets unused
        raise ConfigError(f"data.eod_id={data.eod_id}: must be a token id, from 0 to "
                          f"model.vocab_size - 1 = {model.vocab_size - 1}")
    else:
        tokenizer = DatasetTokenizer(model.vocab_size, data.eod_id, name=f"eod{data.eod_id}")
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size}: smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} tokens ({data.tokenizer_model})")
    return tokenizer


def build_datasets(cfg: RunConfig, step: int = 0, consumed_samples: int = 0):
    """(train, valid) datasets sized for the whole run, resumed at ``step`` with
    ``consumed_samples`` read (``resume.resumed_progress``); valid is None when ``data.split``
    gives it no data and no evaluation is asked for. Raises DataError on bad files."""
    gbs, steps = cfg.train.global_batch_size, cfg.train.train_steps
    # More than train_steps x global_batch_size where a resume shrank the global batch: the
    # steps before it read more samples each.
    samples = (max(steps * gbs, consumed_samples + (steps - step) * gbs),
               cfg.train.eval_iters * gbs, 0)
    build = _build_sft_datasets if cfg.data.format == "sft" else _build_indexed_datasets
    train, valid = build(cfg, samples)
    interval, depths = cfg.train.eval_interval, cfg.train.eval_depths
    asked = (f"train.eval_interval={interval}" if interval
             else f"train.eval_depths={depths}" if depths else None)
    if valid is None and asked:  # no weight or no samples for it: the settings', on every rank
        raise decided_on_every_rank(ConfigError(
            f"data.split={cfg.data.split!r}: gives the validation split no data, but {asked} asks "
            "for evaluations; give it a weight, or train without evaluation "
            "(train.eval_interval=0, train.eval_depths=[])"))
    return train, valid


def data_fingerprint(cfg: RunConfig, train) -> dict[str, dict]:
    """What the run's training data holds, per dataset, in a form cheap to compute: recorded with
    each checkpoint's progress, so that a resume on data rewritten under the same names is told
    (``resume.report_data_changes``) rather than reading other samples without a word (the index
    cache is keyed by the same digests, so it builds new indices silently). Indexed data
    (``train``: build_datasets' training dataset): per prefix, its documents, tokens and the md5
    of its sequence lengths, which megatron-core's sample indices are made from and which
    build_gpt_datasets computed already, and ``indexed.bin_sample_md5``, 1 MiB of the .bin's
    tokens (data tokenized anew keeps every length where its tokenizer splits the text alike);
    the whole .bin is not read, which on a multi-TB dataset would take hours. Fine-tuning
    records: per file, its size and sha256, the file being read and tokenized whole anyway, and
    the sha256 of ``data.tokenizer_model``, which makes the samples of those records (a tokenizer
    trained anew under its name leaves every record file as it was)."""
    if cfg.data.format == "sft":
        records = {path: {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}
                   for path in expand_inputs(cfg.data.path)}
        tokenizer = cfg.data.tokenizer_model
        if tokenizer is not None:  # a directory's tokenizer.json, as HuggingFaceTokenizer reads
            records[tokenizer] = {"tokenizer_sha256": file_sha256(tokenizer_file(tokenizer))}
        return records
    digests, parts = train.config.sequence_lengths_md5, getattr(train, "datasets", [train])
    # Read by rank 0 alone: 16 seeks in each file of a blend of thousands, not on every rank.
    samples = rank0_decides(lambda: {part.dataset.path_prefix: bin_sample_md5(
        part.dataset.path_prefix) for part in parts}, (DataError,))
    return {part.dataset.path_prefix: {
        "documents": len(part.dataset.document_indices) - 1,
        "tokens": int(part.dataset.sequence_lengths.sum(dtype=numpy.int64)),
        "sequence_lengths_md5": digests[part.dataset.path_prefix],
        "bin_sample_md5": samples[part.dataset.path_prefix]}
        for part in parts}  # a BlendedDataset's, or itself


def _build_indexed_datasets(cfg: RunConfig, samples: tuple[int, int, int]):
    def tokenizers():
        text = text_tokenizer(cfg) if cfg.data.tokenizer_model is not None else None
        return text, other_legacy_mode_eod(cfg.data)

    # Loaded on every rank, not inside check(): rank0_decides passes on DataErrors alone, and a
    # TokenizerError raised there on rank 0 would leave the others waiting for its decision.
    # Agreed: a file one node cannot read failed there alone, the others waiting in
    # rank0_decides until the process-group timeout.
    text, other_eod = each_rank_agrees(tokenizers, (ConfigError, TokenizerError))
    tokenizer = dataset_tokenizer(cfg, text)
    prefixes = parse_blend(cfg.data.path)[0]
    cache_dir = cfg.data.cache_dir or Path(prefixes[0]).resolve().parent / "cache"  # mcore's too

    def check() -> dict[str, IndexedSummary]:
        # One read of each .idx per start-up: build_gpt_datasets takes these summaries (on every
        # rank) rather than validating again, which costs seconds per 10M sequences.
        summaries = {prefix: validate_indexed(prefix, tokenizer.vocab_size) for prefix in prefixes}
        check_sidecars(summaries, cfg.data, tokenizer.eod, text.path if text else None)
        check_token_ids(summaries, cfg.model.vocab_size, cache_dir)
        if cfg.data.tokenizer_model is not None:
            check_tokenizer_ids(summaries, cfg.data, tokenizer.vocab_size, cache_dir)
            check_document_ends(summaries, cfg.data, tokenizer.eod, other_eod)
        _check_index_memory(summaries, cfg, samples)
        _make_cache_dir(Path(cache_dir), cfg.data.cache_dir is not None)  # once all else passed
        return summaries

    # Before the datasets: data made with another tokenizer is refused before megatron-core
    # spends minutes building its indices, and leaves none in the cache.
    summaries = rank0_decides(check, (DataError,))
    _readable_on_every_rank(prefixes)
    # Agreed: a cached index one node cannot read (or a corrupt one) failed there alone. Only
    # the build's DataError, raised once megatron-core's barriers are passed: a rank failing in
    # the build itself (an OSError opening the data) leaves at once, for the launcher to end the
    # others, where agreeing on it would have it wait in an all-gather while they wait in the
    # build's next barrier. A refusal before the build (of the settings, or of the split the
    # agreed summaries give) is raised alike on every rank, none waiting: said once, as the
    # settings', not as rank 0's own.
    try:
        datasets, problem = build_gpt_datasets(
            cfg.data.path, tokenizer, cfg.model.seq_length, samples,
            split=cfg.data.split, seed=cfg.train.seed, cache_dir=cfg.data.cache_dir,
            eod_mask_loss=cfg.data.eod_mask_loss, summaries=summaries,
        ), None
    except DataError as e:
        if is_decided_on_every_rank(e):
            raise
        datasets, problem = None, e

    def built():
        if problem is not None:
            raise problem
        return datasets

    train, valid, _ = each_rank_agrees(built, (DataError,))
    if train is None:
        raise ConfigError(f"data.split={cfg.data.split!r}: gives the training split no data")
    if is_rank0():
        for split, dataset in (("train", train), ("valid", valid)):
            _warn_repeats(split, dataset)
    return train, valid


def _readable_on_every_rank(prefixes: list[str]) -> None:
    """Collective: a .bin or .idx that any rank cannot open and read (a node whose mount lacks
    it, or denies it) is a DataError on every rank, naming the file and the rank. Rank 0 alone
    has validated them, and megatron-core's build opens them on every rank: there the rank's
    OSError was a traceback while the other ranks waited in the build's barrier until the
    process-group timeout."""
    def read() -> None:
        for path in (name for prefix in prefixes for name in (idx_path(prefix), bin_path(prefix))):
            with open(path, "rb") as f:
                f.read(1)

    each_rank_agrees(read, (DataError,))


def _check_index_memory(summaries: dict[str, IndexedSummary], cfg: RunConfig,
                        samples: tuple[int, int, int]) -> None:
    """A DataError naming the setting when the indices megatron-core would build in memory for a
    split's samples exceed this node's memory: ``train.eval_iters=1e20`` (say) had it count the
    epochs one by one in a Python loop for hours, then fail for memory, if ever. A lower bound:
    its sample index (two int32 per sample), and its document index (an int32 per document of
    every epoch: at least seq_length tokens per sample over the longest mean document)."""
    longest = max(s.num_tokens / max(s.num_documents, 1) for s in summaries.values())
    per_sample = 8 + 4 * cfg.model.seq_length / max(longest, 1)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gbs = cfg.train.global_batch_size
    for count, setting in zip(samples, _sample_settings(cfg)):
        if count * per_sample > memory:
            raise DataError(
                f"{setting}: x train.global_batch_size={gbs} is {count:,} samples, whose indices "
                f"megatron-core builds in memory: at least {count * per_sample / 2**30:,.0f} GiB "
                f"of {cfg.data.path}, more than this node's {memory / 2**30:,.0f} GiB")


def _sample_settings(cfg: RunConfig) -> tuple[str, str]:
    """What sets the sample counts of the training and validation splits, as a refusal names it."""
    return f"train.train_steps={cfg.train.train_steps}", f"train.eval_iters={cfg.train.eval_iters}"


def _warn_repeats(split: str, dataset) -> None:
    """A warning for each dataset behind ``dataset`` (a BlendedDataset's parts, or itself) whose
    ``split`` the run reads more than once: it draws more samples than the documents hold.
    megatron-core says so at INFO ("total number of epochs"), which megaloop does not show."""
    for part in getattr(dataset, "datasets", [dataset] if dataset is not None else []):
        epochs = len(part.document_index) // len(part.indices)
        if epochs > 1:
            tokens = int(part.dataset.sequence_lengths[part.indices].sum())
            log.warning("data: the run reads the %s split of %s over %d epochs: %s samples of "
                        "model.seq_length=%d tokens from its %s tokens", split,
                        part.dataset.path_prefix, epochs, f"{len(part):,}",
                        part.config.sequence_length, f"{tokens:,}")


def _make_cache_dir(cache_dir: Path, given: bool) -> None:
    """Creates the index cache directory, or refuses it in one line (megatron-core would fail to
    create it with a traceback, other ranks waiting at its barrier). Only created: a read-only
    one may hold every index already."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = (f"data.cache_dir={str(cache_dir)!r}" if given else f"{cache_dir} (the index "
                 "cache beside data.path's first prefix; data.cache_dir sets another)")
        raise DataError(f"{where}: cannot be created ({e.strerror or e}: {e.filename})") from None


def _build_sft_datasets(cfg: RunConfig, samples: tuple[int, int, int]):
    from megaloop.data.sft import build_sft_datasets

    # Its datasets build no index (``_check_index_memory``'s bound), each epoch's order is made
    # when read; but a count beyond what len() holds failed at the split's first batch: the
    # validation split's after the whole training, before the final save.
    for count, setting in zip(samples, _sample_settings(cfg)):
        if count > sys.maxsize:
            raise decided_on_every_rank(ConfigError(
                f"{setting}: x train.global_batch_size={cfg.train.global_batch_size} is "
                f"{count:,} samples, more than a dataset can index ({sys.maxsize:,})"))

    def build():
        dataset_tokenizer(cfg)  # the vocabulary check
        return build_sft_datasets(
            cfg.data.path, text_tokenizer(cfg), cfg.model.seq_length, samples,
            split=cfg.data.split, seed=cfg.train.seed, prompt=cfg.data.sft_prompt,
            solution=cfg.data.sft_solution)

    # Each rank reads the records itself, with no collective: a file one node cannot read failed
    # there alone, the others waiting in training's next collective until the process-group
    # timeout.
    train, valid, _ = each_rank_agrees(build, (DataError, ConfigError))
    if train is None:
        raise ConfigError(f"data.split={cfg.data.split!r}: gives the training split no records")
    return train, valid


def check_sidecars(summaries: dict[str, IndexedSummary], data: DataConfig, eod: int,
                   tokenizer_file: str | None) -> None:
    """Refuses data whose sidecar (``{prefix}.tokenizer.json``, from tools/preprocess_data.py)
    says its ids were made otherwise than the run reads them: another tokenizer type or model file,
    the other ``--legacy-tokenizer`` mode, another EOD id (``eod``: the run's). Also one that
    describes other documents or tokens than the files hold (files replaced after it was written).
    Data without a sidecar (Megatron-LM's) is left to the id and document-end checks. ``summaries``: each
    prefix's ``validate_indexed``, as for the id checks."""
    sidecars = [(prefix, saved) for prefix in summaries if (saved := read_sidecar(prefix))]
    if not sidecars:
        return
    if tokenizer_file is None:
        settings = [("eod_id", "data.eod_id", eod)]
    else:
        settings = [("tokenizer_type", "data.tokenizer_type", data.tokenizer_type),
                    ("tokenizer_sha256", "data.tokenizer_model", file_sha256(tokenizer_file)),
                    ("legacy_tokenizer", "data.legacy_tokenizer", data.legacy_tokenizer),
                    ("eod_id", "the EOD id of data.tokenizer_model", eod)]
    for prefix, saved in sidecars:
        where, summary = sidecar_path(prefix), summaries[prefix]
        for key, held in (("documents", summary.num_documents), ("tokens", summary.num_tokens)):
            if key in saved and saved[key] != held:
                raise DataError(f"{where}: describes {saved[key]} {key}, but {prefix}.bin/.idx "
                                f"hold {held}: it was written for other data; remove it, or "
                                "preprocess the data again")
        for key, field, value in settings:
            if key not in saved or saved[key] == value:
                continue
            if key == "tokenizer_sha256":
                made = (f"tokenizer_model={saved.get('tokenizer_model')!r} "
                        f"(sha256 {saved[key][:12]})")
                run = f"{field}={data.tokenizer_model!r} (sha256 {value[:12]})"
            else:
                made, run = f"{key}={saved[key]!r}", f"{field}={value!r}"
            fix = (f"set {field}={json.dumps(saved[key])}" if field.startswith("data.")
                   and key in ("legacy_tokenizer", "eod_id") else
                   "train with the tokenizer it was made with, or preprocess it again")
            raise DataError(f"{where}: {prefix} was tokenized with {made}, but the run has {run}; "
                            f"{fix}")
    if data.eod_mask_loss:  # it masks the EOD closing each document: none where none was added
        _check_eods_to_mask(summaries, [prefix for prefix, saved in sidecars
                                        if saved.get("append_eod") is False])


def _check_eods_to_mask(summaries: dict[str, IndexedSummary], without: list[str]) -> None:
    """Refuses ``data.eod_mask_loss`` where every prefix was preprocessed without --append-eod
    (``without``, by their sidecars), and notes those where only some were."""
    if without and len(without) == len(summaries):
        raise DataError(f"data.eod_mask_loss=true: {', '.join(without)} "
                        f"{'holds' if len(without) == 1 else 'hold'} no EOD to mask (preprocessed "
                        f"without --append-eod, says {sidecar_path(without[0])}); preprocess "
                        f"{'it' if len(without) == 1 else 'them'} with --append-eod, or set "
                        "data.eod_mask_loss=false")
    for prefix in without:
        log.warning("data.eod_mask_loss=true masks nothing in %s: preprocessed without "
                    "--append-eod (says %s), its documents hold no EOD", prefix,
                    sidecar_path(prefix))


def check_token_ids(summaries: dict[str, IndexedSummary], vocab_size: int,
                    cache_dir: str | os.PathLike) -> None:
    """Refuses data holding a token id >= ``model.vocab_size`` (made with another tokenizer),
    which would otherwise be an IndexError inside step 1 on CPU and a device-side assert on GPU.
    Free when the token dtype cannot hold such an id; otherwise one pass over the .bin, done once
    per file version: the maximum is cached as ``max_token_id-*`` files in the shuffle-index
    cache directory, keyed by the file's size and modification time. ``summaries``: each
    prefix's ``validate_indexed``."""
    for prefix, top in _ids_reaching(summaries, vocab_size, cache_dir):
        raise DataError(f"{prefix}.bin: token id {top} is outside the model's vocabulary "
                        f"(model.vocab_size={vocab_size}); the data was tokenized with "
                        "another tokenizer, or the vocabulary is too small")


def check_tokenizer_ids(summaries: dict[str, IndexedSummary], data: DataConfig,
                        tokenizer_size: int, cache_dir: str | os.PathLike) -> None:
    """Refuses data holding a token id past the ``tokenizer_size`` ids of ``data.tokenizer_model``,
    which no encoding by that tokenizer writes. The id would fit the model's padded vocabulary, so
    training would go on with another end-of-document id than the data's (wrong document
    boundaries, ``eod_mask_loss`` masking the wrong token): tools/preprocess_data.py
    ``--legacy-tokenizer`` with SentencePieceTokenizer, for one, ends documents with an
    ``<EOD>`` id numbered past the model's pieces. Shares check_token_ids' cached scan."""
    for prefix, top in _ids_reaching(summaries, tokenizer_size, cache_dir):
        raise DataError(f"{prefix}.bin: token id {top} is past the {tokenizer_size} ids of "
                        f"data.tokenizer_model={data.tokenizer_model!r}: the data was tokenized "
                        f"otherwise{_legacy_hint(data, top)}")


def other_legacy_mode_eod(data: DataConfig) -> int | None:
    """The EOD id of the other ``data.legacy_tokenizer`` mode than the run's, or None where the
    modes cannot differ (no tokenizer file, or a type other than SentencePieceTokenizer)."""
    if data.tokenizer_model is None or data.tokenizer_type != "SentencePieceTokenizer":
        return None
    return load_tokenizer(data.tokenizer_type, data.tokenizer_model,
                          legacy=not data.legacy_tokenizer).eod


def check_document_ends(summaries: dict[str, IndexedSummary], data: DataConfig, eod: int,
                        other: int | None) -> None:
    """Refuses SentencePieceTokenizer data without a sidecar whose documents all end with
    ``other``, the EOD id of the other ``data.legacy_tokenizer`` mode than the run's (``eod``):
    Megatron-LM ends documents with the model's eos id, but with --legacy-tokenizer with an
    ``<EOD>`` id, the model's own piece when it has one. Such an id is within the vocabulary, so
    the id checks pass, and without a sidecar (Megatron-LM writes none) training would go on with
    document ends it does not see. Only that id is looked for: documents made without
    --append-eod may all end alike (with a newline). Data with a sidecar is left to
    check_sidecars, which reads the mode it was made with: its documents may end with text that
    encodes to the other mode's EOD (a literal "<EOD>" or "</s>") without --append-eod."""
    if other is None or other == eod:
        return
    for prefix, summary in summaries.items():
        if read_sidecar(prefix) is not None:
            continue
        ends = document_last_tokens(summary)
        if len(ends) and (ends == other).all():
            raise DataError(f"{prefix}: its documents end with id {other}, the EOD id of "
                            f"data.tokenizer_model={data.tokenizer_model!r} with "
                            f"data.legacy_tokenizer={json.dumps(not data.legacy_tokenizer)}, but "
                            f"the run's is {eod}; set data.legacy_tokenizer="
                            f"{json.dumps(not data.legacy_tokenizer)}")


def _legacy_hint(data: DataConfig, top: int) -> str:
    """How to train on data from --legacy-tokenizer, when ``top`` is one of its added ids."""
    # SentencePieceTokenizer is the one type whose ids legacy adds to.
    if data.legacy_tokenizer or data.tokenizer_type != "SentencePieceTokenizer":
        return ""
    legacy = load_tokenizer(data.tokenizer_type, data.tokenizer_model, legacy=True)
    if top >= legacy.vocab_size:
        return ""
    return (f" (by its --legacy-tokenizer mode of tools/preprocess_data.py, which ends documents "
            f"with id {legacy.eod}: train on it with data.legacy_tokenizer=true, or without the "
            f"tokenizer with data.eod_id={legacy.eod})")


def _ids_reaching(summaries: dict[str, IndexedSummary], limit: int,
                  cache_dir: str | os.PathLike):
    """(prefix, its largest token id) for each file holding an id >= ``limit``; no scan of a file
    whose token dtype cannot hold one."""
    for prefix, summary in summaries.items():
        if numpy.iinfo(summary.dtype).max < limit:
            continue
        top = _max_token_id(prefix + ".bin", summary, cache_dir)
        if top >= limit:
            yield prefix, top


def _max_token_id(bin_file: str, summary, cache_dir: str | os.PathLike) -> int:
    stat = os.stat(bin_file)
    directory = Path(cache_dir)
    # A name readers._INDEX_CACHE_TEXT knows: a directory input of the data tools leaves it out.
    cached = directory / (f"max_token_id-{Path(bin_file).name}-{stat.st_size}-"
                          f"{stat.st_mtime_ns}.txt")
    try:
        return int(cached.read_text())
    except (OSError, ValueError):
        pass
    top = _scan_max_token_id(bin_file, stat.st_size, stat.st_mtime_ns, summary.dtype,
                             summary.num_tokens)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Atomic: a truncated "31999" read as 319 by a job sharing the cache would pass as the
        # maximum and hide the ids it should refuse.
        write_text_atomic(cached, f"{top}\n")
    except OSError:  # a read-only cache only costs the scan again next time
        pass
    return top


@functools.cache  # by file version: without a writable cache, the two id checks share one scan
def _scan_max_token_id(bin_file: str, size: int, mtime_ns: int, dtype, num_tokens: int) -> int:
    tokens = numpy.memmap(bin_file, dtype=dtype, mode="r")
    top = max((int(tokens[i:i + _SCAN_CHUNK].max()) for i in range(0, num_tokens, _SCAN_CHUNK)),
              default=-1)
    del tokens
    return top


class MicroBatches:
    """Iterator over this rank's micro-batches, starting at ``consumed_samples``."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int, global_batch_size: int):
        self.dataset, self.mbs = dataset, micro_batch_size
        self.dp_rank, self.dp_size, self.gbs = dp_rank, dp_size, global_batch_size
        self.per_step = global_batch_size // (micro_batch_size * dp_size)
        self.consumed, self.micro = consumed_samples, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = self.consumed + (self.micro * self.dp_size + self.dp_rank) * self.mbs
        if start + self.mbs > len(self.dataset):
            raise StopIteration
        samples = [self.dataset[i] for i in range(start, start + self.mbs)]
        self.micro += 1
        if self.micro == self.per_step:  # a global batch is done
            self.consumed, self.micro = self.consumed + self.gbs, 0
        keys = ("tokens", "labels", "loss_mask", "position_ids", "padding_mask")
        return {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                for key in keys if key in samples[0]}  # padding_mask: fine-tuning's only
