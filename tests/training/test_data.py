"""Token ids beyond the model's vocabulary are refused before step 1, cheaply on restarts."""

import os

import pytest

from megaloop.data import DataError
from megaloop.training.data import check_token_ids
from tests.training.conftest import write_pattern_dataset


def _write(prefix, top_id=None):
    """The pattern dataset (ids 0..120), optionally with one document holding ``top_id``."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if top_id is None:
        return write_pattern_dataset(prefix, documents=50)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in ([5, 6, 7, 0], [1, top_id, 2, 0]):
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_ids_beyond_the_vocabulary_are_refused_naming_the_file(tmp_path):
    prefix = _write(tmp_path / "data")
    check_token_ids([prefix], vocab_size=121, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError) as error:
        check_token_ids([prefix], vocab_size=120, cache_dir=tmp_path / "cache")
    assert str(error.value).startswith(f"{prefix}.bin: token id 120 is outside the model's "
                                       "vocabulary (model.vocab_size=120)")


def test_the_scan_is_cached_per_file_version(tmp_path):
    prefix = _write(tmp_path / "data")
    cache = tmp_path / "cache"
    check_token_ids([prefix], vocab_size=128, cache_dir=cache)
    (cached,) = cache.iterdir()
    assert cached.read_text().strip() == "120"
    # A rewritten file (another size and time) is scanned again, not trusted from the cache.
    _write(tmp_path / "data", top_id=500)
    with pytest.raises(DataError, match="token id 500"):
        check_token_ids([prefix], vocab_size=128, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2


def test_no_scan_when_the_token_dtype_cannot_reach_the_vocabulary(tmp_path):
    prefix = _write(tmp_path / "data")  # uint16: ids <= 65535
    check_token_ids([prefix], vocab_size=70_000, cache_dir=tmp_path / "cache")
    assert not os.path.exists(tmp_path / "cache")
