"""Token ids beyond the model's vocabulary, or past the tokenizer's (data tokenized otherwise), are
refused before step 1, cheaply on restarts."""

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


def _write_legacy_tokenized(prefix, sp_model, copies=1):
    """Two documents, ``copies`` times, as preprocess_data.py --legacy-tokenizer writes them."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megaloop.data import load_tokenizer

    legacy = load_tokenizer("SentencePieceTokenizer", sp_model, legacy=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    texts = ["The cat sat on the mat.", "A second <SEP> document."] * copies
    for ids in legacy.encode_batch(texts):
        builder.add_item(torch.tensor(ids + [legacy.eod]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix), legacy.eod


@pytest.fixture
def sp_model():
    from tests.data.conftest import SP_MODEL

    if not SP_MODEL.is_file():
        pytest.skip(f"{SP_MODEL} not available")
    return SP_MODEL


def test_data_from_the_legacy_tokenizer_is_refused_with_its_eod_id_named(tmp_path, sp_model):
    from megaloop.config import DataConfig
    from megaloop.training.data import check_tokenizer_ids

    prefix, eod = _write_legacy_tokenized(tmp_path / "legacy", str(sp_model))
    assert eod == 32002  # <EOD> past the 32000 pieces, where the tokenizer's own EOD is 2
    check_token_ids([prefix], vocab_size=32128, cache_dir=tmp_path / "cache")  # the model's rows
    data = DataConfig(path=[prefix], tokenizer_model=str(sp_model))
    with pytest.raises(DataError) as error:
        check_tokenizer_ids([prefix], data, 32000, cache_dir=tmp_path / "cache")
    assert str(error.value) == (
        f"{prefix}.bin: token id 32002 is past the 32000 ids of data.tokenizer_model="
        f"{str(sp_model)!r}: the data was tokenized otherwise (by its --legacy-tokenizer mode of "
        "tools/preprocess_data.py, which ends documents with id 32002: train on it with "
        "data.eod_id=32002 in place of data.tokenizer_model)")
    check_tokenizer_ids([prefix], data, 32003, cache_dir=tmp_path / "cache")


def test_the_trainer_refuses_legacy_data_with_the_tokenizer_and_takes_it_with_its_eod_id(
        mcore, tmp_path, sp_model):
    from megaloop.training.trainer import Trainer
    from tests.training.conftest import tiny_run

    prefix, eod = _write_legacy_tokenized(tmp_path / "legacy", str(sp_model), copies=40)
    cfg = tiny_run(prefix, tmp_path / "run", model={"vocab_size": 32128})
    cfg.data.eod_id, cfg.data.tokenizer_model = None, str(sp_model)
    with pytest.raises(DataError, match=f"token id {eod} is past the 32000 ids of "
                                        "data.tokenizer_model="):
        Trainer(cfg)
    cfg.data.eod_id, cfg.data.tokenizer_model = eod, None
    with Trainer(cfg) as trainer:
        assert trainer.train_data.config.tokenizer.eod == eod
