"""Train/valid/test GPT datasets from Megatron .bin/.idx prefixes, via megatron-core.

``build_gpt_datasets`` wraps megatron-core's ``GPTDataset`` and ``BlendedMegatronDatasetBuilder``
(splits, weighted blends, seeded shuffling, EOD-aware masks) and adds what they leave to the
caller:

- every prefix is validated first (``indexed.validate_indexed``, here or by the caller), so a
  truncated or mismatched .bin/.idx fails with one error naming the file rather than deep inside
  a sampler;
- a split that would get no tokens is refused: megatron-core's ``_get_num_epochs`` loops forever
  on it;
- the cache of shuffle/sample indices is safe to share between jobs (``index_cache``): writes are
  atomic, one job builds while another waits for its files, and the cache key covers the data's
  sequence lengths, not only its path;
- a cached index that cannot be read or written (corrupt, or unreadable on one node) is a
  DataError naming the file, raised once megatron-core's build has passed every barrier: the
  caller can agree on it across ranks (megaloop.training.data does); a refusal of the arguments
  alone, or of the split that summaries the caller gave leave empty, comes before any collective
  and is the same on every rank: marked ``cli.decided_on_every_rank``, said once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import pickle
import warnings
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy

from megaloop.cli import decided_on_every_rank
from megaloop.data.blend import SPLIT_NAMES, SPLIT_RULE, parse_blend, split_weights
from megaloop.data.index_cache import (atomic_npy_writes, before_building, exclusive_build,
                                       sequence_lengths_md5)
from megaloop.data.indexed import IndexedSummary, sequence_lengths, validate_indexed
from megaloop.data.readers import DataError



class DatasetTokenizer:
    """The part of a tokenizer GPTDataset uses: vocab size, EOD id and a cache identity.

    ``unique_identifiers`` feeds megatron-core's cache key, so two tokenizers never share indices.
    """

    def __init__(self, vocab_size: int, eod: int, name: str):
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = OrderedDict(cls=type(self).__name__, name=name, vocab_size=vocab_size, eod=eod)

    @classmethod
    def from_text_tokenizer(cls, tokenizer) -> DatasetTokenizer:
        """From a ``megaloop.data.tokenizer.load_tokenizer`` result."""
        if tokenizer.eod is None:
            raise DataError(f"{tokenizer.path}: the tokenizer has no end-of-text token to use as EOD")
        return cls(tokenizer.vocab_size, tokenizer.eod, os.path.basename(tokenizer.path))


def build_gpt_datasets(
    data_path: Sequence[str] | None,
    tokenizer: DatasetTokenizer,
    seq_length: int,
    num_samples: Sequence[int | None] = (None, None, None),
    *,
    split: str = "969,30,1",
    per_split_data_paths: Sequence[Sequence[str] | None] | None = None,
    seed: int = 1234,
    cache_dir: str | None = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    create_attention_mask: bool = False,
    check_token_ids: bool = False,
    is_built_on_rank: Callable[[], bool] = lambda: True,
    summaries: Mapping[str, IndexedSummary] | None = None,
) -> list:
    """Build ``[train, valid, test]`` datasets (an entry is None for an empty split).

    Either ``data_path`` (one blend, cut into splits by ``split``, e.g. "969,30,1") or
    ``per_split_data_paths`` (a blend per split, used whole) names the data. ``num_samples`` is
    the samples wanted per split; None takes one epoch (then blend weights must be absent, as
    megatron-core requires). Samples are dicts of ``tokens, labels, loss_mask, position_ids``
    (and ``attention_mask`` when asked), each ``seq_length`` long. ``cache_dir`` (default:
    ``cache/`` beside the first prefix) holds the shuffle indices, keyed by every setting here.
    Blends of several datasets need torch.distributed initialised (a world of 1 is fine).
    ``summaries``: each prefix's ``validate_indexed(prefix, tokenizer.vocab_size)`` when the
    caller has made it already (the trainer's start-up checks), so the files are not read twice;
    a prefix missing from it is validated here.
    """
    import torch

    mcore = _import_mcore_datasets()
    if summaries and check_token_ids:
        raise ValueError("check_token_ids scans the files while validating them: give it or summaries")
    try:
        blend, blend_per_split = _blends(data_path, per_split_data_paths, split, num_samples)
    except DataError as e:
        raise decided_on_every_rank(e) from None
    prefixes = blend[0] if blend else [p for b in blend_per_split if b for p in b[0]]
    if len(prefixes) > 1 and not torch.distributed.is_initialized():  # a single process's
        raise DataError(
            "blending several datasets needs torch.distributed initialised (megatron-core's "
            "BlendedDataset asks for the rank); a world of 1 is fine"
        )
    known = summaries or {}
    summaries = {p: known[p] if p in known else
                 validate_indexed(p, tokenizer.vocab_size, check_token_ids) for p in prefixes}
    if blend is not None:
        try:
            _check_splits_have_tokens(summaries, split, num_samples, mcore)
        except DataError as e:
            # The caller's summaries are the same on every rank (the trainer's: rank 0's).
            raise decided_on_every_rank(e) if set(prefixes) <= set(known) else e from None
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")
    config = mcore.GPTDatasetConfig(
        sequence_lengths_md5={p: sequence_lengths_md5(s) for p, s in summaries.items()},
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split if blend is not None else None,
        tokenizer=tokenizer,
        path_to_cache=cache_dir,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    builder = mcore.BlendedMegatronDatasetBuilder(mcore.GPTDataset, list(num_samples), is_built_on_rank, config)
    # megatron-core builds missing indices on global rank 0 only (or without torch.distributed);
    # the other ranks wait at its barriers, then load.
    builds_here = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    with exclusive_build(cache_dir) if builds_here else contextlib.nullcontext(), \
            atomic_npy_writes(), _checked_blended_datasets(mcore):
        datasets = builder.build()
    problem = next((part.cache_problem for dataset in datasets if dataset is not None
                    for part in [dataset, *getattr(dataset, "datasets", [])]
                    if getattr(part, "cache_problem", None)), None)
    if problem is not None:  # after megatron-core's barriers: see _indices_or_problem
        raise DataError(problem)
    return datasets


def _blends(data_path, per_split_data_paths, split: str, num_samples: Sequence[int | None]):
    """``(blend, blend_per_split)`` as megatron-core's config takes them, or a DataError that
    follows from build_gpt_datasets' arguments alone, before any file is read: every rank, given
    the same arguments (as megatron-core's build needs), raises it alike."""
    if (data_path is None) == (per_split_data_paths is None):
        raise DataError("give exactly one of data_path and per_split_data_paths")
    blend = parse_blend(data_path) if data_path is not None else None
    blend_per_split = None
    if per_split_data_paths is not None:
        blend_per_split = [parse_blend(p) if p else None for p in per_split_data_paths]
    weighted = [b for b in ([blend] if blend else blend_per_split) if b and b[1] is not None]
    if weighted and any(n is None for n in num_samples):
        # megatron-core only asserts this deep inside its builder.
        raise DataError("a weighted blend needs a sample count for every split (0 for an unused one), not None")
    if blend is not None and split_weights(split) is None:  # megatron-core reads "-1,2" as 1,2
        raise DataError(f"split {split!r}: must be {SPLIT_RULE}")
    return blend, blend_per_split


def _check_splits_have_tokens(summaries: dict, split: str, num_samples: Sequence[int | None], mcore) -> None:
    """Refuse a split that megatron-core would carve as empty. It builds every split of non-zero
    weight, even one the run draws no samples from, and for an empty one it loops forever looking
    for the one token a sample index needs (GPTDataset._get_num_epochs): a silent hang."""
    matrix = mcore.convert_split_vector_to_split_matrix(mcore.parse_and_normalize_split(split))
    for prefix, summary in summaries.items():
        lengths = sequence_lengths(summary)
        n = summary.num_sequences  # GPTDataset splits by sequence, as numel_low_level_dataset says
        for i, bounds in enumerate(matrix):
            if bounds is None:
                continue
            # The same rounding as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
            beg, end = int(round(bounds[0] * float(n))), int(round(bounds[1] * float(n)))
            if int(lengths[beg:end].sum()) == 0:
                unused = " (which this run draws no samples from)" if num_samples[i] == 0 else ""
                raise DataError(
                    f"{prefix}: split {split!r} gives the {SPLIT_NAMES[i]} split{unused} {end - beg} "
                    f"of its {n} documents and no tokens, which megatron-core cannot build; use "
                    f"more data or a split such as {_split_without(split, i)!r}"
                )


def _split_without(split: str, index: int) -> str:
    """``split`` with the weight of part ``index`` moved to the training part (or, for the
    training part, all weight given to it): a split that leaves that part empty."""
    weights = split_weights(split)
    if index == 0 or weights is None:
        return "100,0,0"
    weights[0], weights[index] = weights[0] + weights[index], 0.0
    return ",".join(f"{w:g}" for w in weights)


@functools.cache
def _import_mcore_datasets():
    """megatron-core's dataset classes, with its C++ index helpers compiled if the wheel lacks them.

    GPTDataset and its config gain ``sequence_lengths_md5`` ({prefix: digest}) in the settings
    that name cached indices: megatron-core keys them by the dataset's path alone.
    """
    import dataclasses
    import types

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Transformer Engine / Apex missing: irrelevant here
        from megatron.core.datasets import blended_megatron_dataset_config as cfg
        from megatron.core.datasets import blended_dataset
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    _ensure_helpers()

    @dataclasses.dataclass
    class FingerprintedGPTDatasetConfig(GPTDatasetConfig):
        sequence_lengths_md5: dict[str, str] | None = None

    class FingerprintedGPTDataset(GPTDataset):
        @staticmethod
        def _key_config_attributes() -> list[str]:
            return [*GPTDataset._key_config_attributes(), "sequence_lengths_md5"]

        def _build_document_sample_shuffle_indices(self):
            cached = self._cached()
            if not cached:
                before_building()  # the build lock, before minutes of computing the indices
            return _indices_or_problem(self, super()._build_document_sample_shuffle_indices,
                                       cached, self._cache_files()[1:])

        def _cached(self) -> bool:
            return all(os.path.isfile(path) for path in self._cache_files())

        def _cache_files(self) -> list[str]:
            # megatron-core's names and cache-hit test (GPTDataset._build_document_sample_
            # shuffle_indices); should they change, every index looks missing, and takes the lock.
            base = os.path.join(self.config.path_to_cache, f"{self.unique_description_hash}-"
                                f"{type(self).__name__}-{self.index_split.name}-")
            return [base + name for name in ("description.txt", "document_index.npy",
                                             "sample_index.npy", "shuffle_index.npy")]

    class BlendedDataset(blended_dataset.BlendedDataset):  # its name: in its cache files' and key
        def _build_indices(self):
            base = os.path.join(self.config.path_to_cache or "", f"{self.unique_description_hash}-"
                                f"{type(self).__name__}-{self.split.name}-")
            files = [base + "dataset_index.npy", base + "dataset_sample_index.npy"]
            cached = bool(self.config.path_to_cache) and all(map(os.path.isfile, files))
            return _indices_or_problem(self, super()._build_indices, cached, files)

    return types.SimpleNamespace(
        BlendedDataset=BlendedDataset,
        BlendedMegatronDatasetBuilder=BlendedMegatronDatasetBuilder,
        GPTDataset=FingerprintedGPTDataset,
        GPTDatasetConfig=FingerprintedGPTDatasetConfig,
        convert_split_vector_to_split_matrix=cfg.convert_split_vector_to_split_matrix,
        parse_and_normalize_split=cfg.parse_and_normalize_split,
    )


def _indices_or_problem(dataset, build: Callable[[], tuple], cached: bool, files: list[str]):
    """``build()``: a megatron-core dataset's indices, loaded from the cache (``cached``: its
    ``files`` are there) or built and saved there. When the cache cannot be read or written, the
    problem is noted (``dataset.cache_problem``) and the indices are built in memory, not
    cached, for build_gpt_datasets to raise it after the build: megatron-core loads or builds
    each dataset between barriers, and a rank that raised here left the others waiting in the
    next one until the process-group timeout, with a traceback not naming the file (numpy:
    "mmap length is greater than file size")."""
    try:
        if cached:
            _refuse_pickles(files)
        return build()
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
        dataset.cache_problem = _problem_of(e, cached, files)
    config, dataset.config = dataset.config, copy.copy(dataset.config)
    dataset.config.path_to_cache, dataset.config.mock = None, True  # mock: no default cache
    try:
        with _unsaved_indices_unsaid():
            return build()
    finally:
        dataset.config = config


def _refuse_pickles(files: list[str]) -> None:
    """Raises ValueError for a cached index that is not a plain numpy array: megatron-core loads
    them with ``allow_pickle=True``, which runs any pickle found under an index's name (a cache
    directory is often shared, and writable by others)."""
    for path in files:
        numpy.load(path, mmap_mode="r", allow_pickle=False)


def _problem_of(error: Exception, cached: bool, files: list[str]) -> str:
    """``error`` of reading or writing the cache, in words naming the file; raised again when it
    is not the cache's (an error computing indices that are not cached, or cached ``files`` that
    load)."""
    if isinstance(error, OSError) and error.filename:
        return f"{error.filename}: {error.strerror or error}"
    if not cached:
        raise error
    for path in files:
        try:
            numpy.load(path, mmap_mode="r", allow_pickle=False)
        except OSError as e:
            return f"{path}: {e.strerror or e}"
        except (ValueError, EOFError) as e:
            if "allow_pickle" in str(e):
                return (f"{path}: a pickle, not a numpy index; not loaded, since unpickling runs "
                        "code: delete it, and the next run builds it again")
            return f"{path}: corrupt ({e}); delete it, and the next run builds it again"
    raise error


@contextlib.contextmanager
def _unsaved_indices_unsaid():
    """Without megatron-core's warnings that indices built with no cache directory are not
    saved (those of a dataset whose cached ones could not be used: its error says so)."""
    unsaved = logging.Filter()
    unsaved.filter = lambda record: "because path_to_cache is None" not in record.getMessage()
    loggers = [logging.getLogger(f"megatron.core.datasets.{name}")
               for name in ("gpt_dataset", "blended_dataset")]
    for logger in loggers:
        logger.addFilter(unsaved)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(unsaved)


@contextlib.contextmanager
def _checked_blended_datasets(mcore):
    """megatron-core's builder making ``mcore.BlendedDataset``s, whose cache problems are noted
    as those of a GPTDataset (the builder names the class in its module)."""
    from megatron.core.datasets import blended_megatron_dataset_builder as module

    original, module.BlendedDataset = module.BlendedDataset, mcore.BlendedDataset
    try:
        yield
    finally:
        module.BlendedDataset = original


def _ensure_helpers() -> None:
    # megatron-core 0.16.1's wheel ships helpers_cpp; source installs need it built with `make`.
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        return
    except ImportError:
        pass
    import torch
    from megatron.core.datasets.utils import compile_helpers

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        try:
            compile_helpers()
        except SystemExit:  # compile_helpers exits the process on failure
            raise RuntimeError("could not compile megatron-core's dataset helpers (needs make, g++ and Python headers)")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
