"""Token ids beyond the model's vocabulary, or past the tokenizer's (data tokenized otherwise), are
refused before step 1, cheaply on restarts; so are settings that the data's tokenizer sidecar
contradicts. Data from --legacy-tokenizer trains with data.legacy_tokenizer=true."""

import os

import pytest

from megaloop.data import DataError
from megaloop.data import validate_indexed
from megaloop.training.data import check_token_ids
from tests.training.conftest import write_pattern_dataset


def _indexed(prefix) -> dict:
    """What the checks take: each prefix's summary, validated once."""
    return {prefix: validate_indexed(prefix)}


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
    check_token_ids(_indexed(prefix), vocab_size=121, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError) as error:
        check_token_ids(_indexed(prefix), vocab_size=120, cache_dir=tmp_path / "cache")
    assert str(error.value).startswith(f"{prefix}.bin: token id 120 is outside the model's "
                                       "vocabulary (model.vocab_size=120)")


def test_the_scan_is_cached_per_file_version(tmp_path):
    prefix = _write(tmp_path / "data")
    cache = tmp_path / "cache"
    check_token_ids(_indexed(prefix), vocab_size=128, cache_dir=cache)
    (cached,) = cache.iterdir()
    assert cached.read_text().strip() == "120"
    # A rewritten file (another size and time) is scanned again, not trusted from the cache.
    _write(tmp_path / "data", top_id=500)
    with pytest.raises(DataError, match="token id 500"):
        check_token_ids(_indexed(prefix), vocab_size=128, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2


def test_no_scan_when_the_token_dtype_cannot_reach_the_vocabulary(tmp_path):
    prefix = _write(tmp_path / "data")  # uint16: ids <= 65535
    check_token_ids(_indexed(prefix), vocab_size=70_000, cache_dir=tmp_path / "cache")
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
    # the model's rows
    check_token_ids(_indexed(prefix), vocab_size=32128, cache_dir=tmp_path / "cache")
    data = DataConfig(path=[prefix], tokenizer_model=str(sp_model))
    with pytest.raises(DataError) as error:
        check_tokenizer_ids(_indexed(prefix), data, 32000, cache_dir=tmp_path / "cache")
    assert str(error.value) == (
        f"{prefix}.bin: token id 32002 is past the 32000 ids of data.tokenizer_model="
        f"{str(sp_model)!r}: the data was tokenized otherwise (by its --legacy-tokenizer mode of "
        "tools/preprocess_data.py, which ends documents with id 32002: train on it with "
        "data.legacy_tokenizer=true, or without the tokenizer with data.eod_id=32002)")
    check_tokenizer_ids(_indexed(prefix), data, 32003, cache_dir=tmp_path / "cache")
    # With the legacy encoding asked for already, the hint would name the setting that failed.
    data.legacy_tokenizer = True
    with pytest.raises(DataError) as error:
        check_tokenizer_ids(_indexed(prefix), data, 32000, cache_dir=tmp_path / "cache")
    assert str(error.value).endswith("the data was tokenized otherwise")


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
    cfg.data.eod_id, cfg.data.tokenizer_model, cfg.data.legacy_tokenizer = None, str(sp_model), True
    with Trainer(cfg) as trainer:
        assert trainer.train_data.config.tokenizer.eod == eod


# ------------------------------------------------ the sidecar tools/preprocess_data.py writes

def _preprocess(tmp_path, sp_model, legacy, copies=1,
                texts=("The cat sat on the mat.", "A second <SEP> document."), append_eod=True):
    """``texts``, ``copies`` times, through megaloop's preprocessing (sidecar included)."""
    import json

    from megaloop.data.preprocess import PreprocessOptions, output_prefix, preprocess, whole_files

    source = tmp_path / "docs.jsonl"
    texts = list(texts) * copies
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / ("legacy" if legacy else "plain"))
    options = PreprocessOptions("SentencePieceTokenizer", str(sp_model), append_eod=append_eod,
                                workers=0, legacy_tokenizer=legacy)
    preprocess(whole_files([str(source)]), prefix, options)
    return output_prefix(prefix, "text")


@pytest.mark.parametrize("data, made, run, fix", [
    ({}, "legacy_tokenizer=True", "data.legacy_tokenizer=False", "set data.legacy_tokenizer=true"),
    ({"tokenizer_type": "Llama2Tokenizer", "legacy_tokenizer": True}, "tokenizer_type="
     "'SentencePieceTokenizer'", "data.tokenizer_type='Llama2Tokenizer'",
     "train with the tokenizer it was made with, or preprocess it again"),
    ({"tokenizer_model": None, "eod_id": 2}, "eod_id=32002", "data.eod_id=2",
     "set data.eod_id=32002"),
])
def test_settings_the_sidecar_contradicts_are_refused_naming_it(tmp_path, sp_model, data, made,
                                                                run, fix):
    from megaloop.config import DataConfig
    from megaloop.data import load_tokenizer
    from megaloop.training.data import check_sidecars

    prefix = _preprocess(tmp_path, sp_model, legacy=True)
    data = DataConfig(path=[prefix], **{"tokenizer_model": str(sp_model), **data})
    tokenizer = data.tokenizer_model and load_tokenizer(data.tokenizer_type, data.tokenizer_model,
                                                        legacy=data.legacy_tokenizer)
    eod = tokenizer.eod if tokenizer else data.eod_id
    with pytest.raises(DataError) as error:
        check_sidecars(_indexed(prefix), data, eod, tokenizer and tokenizer.path)
    assert str(error.value) == (f"{prefix}.tokenizer.json: {prefix} was tokenized with {made}, "
                                f"but the run has {run}; {fix}")


def test_another_model_file_is_refused_and_matching_settings_pass(tmp_path, sp_model):
    import shutil

    from megaloop.config import DataConfig
    from megaloop.training.data import check_sidecars

    prefix = _preprocess(tmp_path, sp_model, legacy=False)
    data = DataConfig(path=[prefix], tokenizer_model=str(sp_model))
    check_sidecars(_indexed(prefix), data, 2, str(sp_model))
    check_sidecars(_indexed(prefix), DataConfig(path=[prefix], eod_id=2), 2, None)
    other = tmp_path / "other.model"
    shutil.copy(sp_model, other)
    with open(other, "ab") as f:
        f.write(b"\0")
    with pytest.raises(DataError, match=r"tokenized with tokenizer_model='llama2_tokenizer.model' "
                                        r"\(sha256 9e556afd4421\), but the run has "
                                        r"data.tokenizer_model='.*' \(sha256 [0-9a-f]{12}\); train "
                                        "with the tokenizer it was made with"):
        check_sidecars(_indexed(prefix), data, 2, str(other))


def test_a_sidecar_left_from_other_files_or_unreadable_is_refused_and_none_is_fine(tmp_path,
                                                                                   sp_model):
    import json

    from megaloop.config import DataConfig
    from megaloop.training.data import check_sidecars

    prefix = _preprocess(tmp_path, sp_model, legacy=False)
    data = DataConfig(path=[prefix], eod_id=2)
    sidecar = tmp_path / "plain_text_document.tokenizer.json"
    record = json.loads(sidecar.read_text())
    assert record["documents"] == 2 and record["append_eod"] and record["vocab_size"] == 32000
    sidecar.write_text(json.dumps({**record, "tokens": record["tokens"] + 1}))
    with pytest.raises(DataError) as error:
        check_sidecars(_indexed(prefix), data, 2, None)
    assert str(error.value) == (f"{sidecar}: describes {record['tokens'] + 1} tokens, but "
                                f"{prefix}.bin/.idx hold {record['tokens']}: it was written for "
                                "other data; remove it, or preprocess the data again")
    sidecar.write_text("{not json")
    with pytest.raises(DataError, match=f"^{sidecar}: unreadable tokenizer sidecar"):
        check_sidecars(_indexed(prefix), data, 2, None)
    sidecar.unlink()  # as Megatron-LM's data: only the id checks apply
    check_sidecars(_indexed(prefix), data, 32002, None)


def test_the_trainer_refuses_legacy_data_by_its_sidecar_and_trains_with_its_eod_id(
        mcore, tmp_path, sp_model):
    from megaloop.training.trainer import Trainer
    from tests.training.conftest import tiny_run

    prefix = _preprocess(tmp_path, sp_model, legacy=True, copies=40)
    cfg = tiny_run(prefix, tmp_path / "run", model={"vocab_size": 32128})
    cfg.data.eod_id, cfg.data.tokenizer_model = None, str(sp_model)
    with pytest.raises(DataError, match=r"tokenized with legacy_tokenizer=True, but the run has "
                                        r"data.legacy_tokenizer=False; set data.legacy"):
        Trainer(cfg)
    cfg.data.legacy_tokenizer, cfg.data.eod_mask_loss = True, True
    with Trainer(cfg) as trainer:
        sample = trainer.train_data[0]  # megatron-core masks the loss where the input is EOD
        ends = sample["tokens"] == 32002
        assert ends.any() and not sample["loss_mask"][ends].any()  # EOD is the data's id
        assert sample["loss_mask"][~ends].all()


def test_data_made_with_another_tokenizer_is_refused_before_any_index_is_built(tmp_path,
                                                                               sp_model):
    from megaloop.training.data import build_datasets
    from tests.training.conftest import tiny_run

    prefix = _preprocess(tmp_path, sp_model, legacy=True, copies=40)
    cfg = tiny_run(prefix, tmp_path / "run", model={"vocab_size": 32128})
    cfg.data.eod_id, cfg.data.tokenizer_model = None, str(sp_model)
    with pytest.raises(DataError, match="tokenized with legacy_tokenizer=True"):
        build_datasets(cfg)
    # Before: megatron-core built (and cached) the shuffle indices first, then the sidecar
    # check refused the data.
    cache = tmp_path / "run" / "cache"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_without_a_writable_cache_the_two_id_checks_share_one_scan(tmp_path, sp_model,
                                                                   monkeypatch):
    import numpy

    from megaloop.config import DataConfig
    from megaloop.training.data import check_tokenizer_ids

    prefix, _ = _write_legacy_tokenized(tmp_path / "legacy", str(sp_model))
    (tmp_path / "file").write_text("")
    unwritable = tmp_path / "file" / "cache"  # below a file: the scan's result cannot be kept
    scans, memmap = [], numpy.memmap

    def counted(path, *args, **kwargs):
        scans.extend([path] if str(path).endswith(".bin") else [])
        return memmap(path, *args, **kwargs)

    monkeypatch.setattr(numpy, "memmap", counted)
    summaries = _indexed(prefix)
    check_token_ids(summaries, vocab_size=32128, cache_dir=unwritable)
    check_tokenizer_ids(summaries, DataConfig(path=[prefix], tokenizer_model=str(sp_model),
                                              legacy_tokenizer=True), 32003, cache_dir=unwritable)
    assert scans == [f"{prefix}.bin"]  # before: scanned once per check


def test_each_prefix_is_validated_once_per_start_up(tmp_path, pattern_data, monkeypatch):
    from megaloop.data import datasets
    from megaloop.training import data
    from tests.training.conftest import tiny_run

    validated = []

    def counted(prefix, *args, **kwargs):
        validated.append(prefix)
        return validate_indexed(prefix, *args, **kwargs)

    monkeypatch.setattr(data, "validate_indexed", counted)
    monkeypatch.setattr(datasets, "validate_indexed", counted)
    train, valid = data.build_datasets(tiny_run(pattern_data, tmp_path / "run"))
    assert train is not None and valid is not None
    assert validated == [pattern_data]  # before: the start-up checks, then build_gpt_datasets


def test_data_ending_documents_with_the_other_legacy_modes_eod_is_refused(tmp_path):
    """A model with its own <EOD> piece: --legacy-tokenizer ends documents with it, the default
    with eos, both within the vocabulary. Without a sidecar (Megatron-LM's data) only the document
    ends tell them apart."""
    from megaloop.config import DataConfig
    from megaloop.data import load_tokenizer
    from megaloop.data.tokenizer_training import train_sentencepiece
    from megaloop.data.indexed import document_last_tokens
    from megaloop.training.data import build_datasets, check_document_ends
    from tests.data.conftest import SHARED_DATA
    from tests.training.conftest import tiny_run

    corpus = SHARED_DATA / "tinyshakespeare.txt"
    if not corpus.is_file():
        pytest.skip(f"{corpus} not available")
    model = str(tmp_path / "eod.model")
    lines = [line for line in corpus.read_text().splitlines() if line.strip()][:2000]
    train_sentencepiece(lines, model, vocab_size=400, special_tokens=["<EOD>"],
                        hard_vocab_limit=False, threads=1)
    eods = {legacy: load_tokenizer("SentencePieceTokenizer", model, legacy=legacy).eod
            for legacy in (False, True)}
    assert eods == {False: 2, True: 3}
    for made in (False, True):
        # No special-token string in the text: its legacy id would be past the model's pieces,
        # which the id checks refuse already.
        prefix = _preprocess(tmp_path, model, legacy=made, copies=3, texts=lines[:2])
        os.remove(f"{prefix}.tokenizer.json")
        check_document_ends(_indexed(prefix), DataConfig(path=[prefix], tokenizer_model=model,
                                                         legacy_tokenizer=made), eods[made],
                            eods[not made])
        cfg = tiny_run(prefix, tmp_path / "run", model={"vocab_size": 512})
        cfg.data.eod_id, cfg.data.tokenizer_model = None, model
        cfg.data.legacy_tokenizer = not made
        with pytest.raises(DataError) as error:
            build_datasets(cfg)  # before: trained with an EOD id the data does not hold
        setting = "true" if made else "false"
        assert str(error.value) == (
            f"{prefix}: its documents end with id {eods[made]}, the EOD id of data.tokenizer_model="
            f"{model!r} with data.legacy_tokenizer={setting}, but the run's is {eods[not made]}; "
            f"set data.legacy_tokenizer={setting}")
    # Data with its sidecar is judged by the mode the sidecar records: documents made without
    # --append-eod whose text ends in a literal "<EOD>" end with the legacy EOD id, and that is
    # no reason to refuse the default mode they were made in (before: refused in either mode).
    (tmp_path / "text").mkdir()
    prefix = _preprocess(tmp_path / "text", model, legacy=False, copies=3, append_eod=False,
                         texts=[line + " <EOD>" for line in lines[:2]])
    assert (document_last_tokens(_indexed(prefix)[prefix]) == eods[True]).all()
    plain = DataConfig(path=[prefix], tokenizer_model=model, legacy_tokenizer=False)
    check_document_ends(_indexed(prefix), plain, eods[False], eods[True])
    os.remove(f"{prefix}.tokenizer.json")
    with pytest.raises(DataError):  # the same documents, as Megatron-LM's data, cannot be told
        check_document_ends(_indexed(prefix), plain, eods[False], eods[True])


@pytest.mark.parametrize("eod_id", [-1, 128])
def test_an_eod_id_no_token_can_have_is_refused(tmp_path, eod_id):
    """Before: accepted, and no document end was ever found (eod_mask_loss masked nothing)."""
    from megaloop.config import ConfigError
    from megaloop.training.data import dataset_tokenizer
    from tests.training.conftest import tiny_run

    cfg = tiny_run("unused", tmp_path)
    cfg.data.eod_id = eod_id
    with pytest.raises(ConfigError) as error:
        dataset_tokenizer(cfg)
    assert str(error.value) == (f"data.eod_id={eod_id}: must be a token id, from 0 to "
                                "model.vocab_size - 1 = 127")
    cfg.data.eod_id = 127
    assert dataset_tokenizer(cfg).eod == 127


def test_eod_mask_loss_on_data_preprocessed_without_eods_is_refused_or_noted(tmp_path, sp_model,
                                                                            caplog):
    """Before: data.eod_mask_loss=true on data whose sidecar says it was preprocessed without
    --append-eod masked nothing, without a word."""
    import logging

    from megaloop.config import DataConfig
    from megaloop.training.data import check_sidecars

    plain = _preprocess(tmp_path, sp_model, legacy=False, append_eod=False)
    (tmp_path / "eods").mkdir()
    ended = _preprocess(tmp_path / "eods", sp_model, legacy=False)
    data = DataConfig(path=[plain], tokenizer_model=str(sp_model), eod_mask_loss=True)
    with pytest.raises(DataError) as error:
        check_sidecars(_indexed(plain), data, 2, str(sp_model))
    assert str(error.value) == (
        f"data.eod_mask_loss=true: {plain} holds no EOD to mask (preprocessed without "
        f"--append-eod, says {plain}.tokenizer.json); preprocess it with --append-eod, or set "
        "data.eod_mask_loss=false")
    with caplog.at_level(logging.INFO, logger="megaloop.train"):
        check_sidecars({**_indexed(plain), **_indexed(ended)}, data, 2, str(sp_model))
        assert caplog.messages == [
            f"data.eod_mask_loss=true masks nothing in {plain}: preprocessed without "
            f"--append-eod (says {plain}.tokenizer.json), its documents hold no EOD"]
        caplog.clear()
        check_sidecars(_indexed(plain), DataConfig(path=[plain], tokenizer_model=str(sp_model)),
                       2, str(sp_model))
    assert not caplog.messages


def test_an_index_cache_directory_that_cannot_be_created_is_one_line(tmp_path, pattern_data):
    """Before: NotADirectoryError/FileExistsError tracebacks from megatron-core's index build."""
    import shutil

    from megaloop.training.data import build_datasets
    from tests.training.conftest import tiny_run

    (tmp_path / "file").write_text("x")
    cfg = tiny_run(pattern_data, tmp_path / "run")
    cfg.data.cache_dir = str(tmp_path / "file" / "cache")
    with pytest.raises(DataError) as error:
        build_datasets(cfg)
    assert str(error.value) == (f"data.cache_dir={cfg.data.cache_dir!r}: cannot be created "
                                f"(Not a directory: {cfg.data.cache_dir})")
    for suffix in (".bin", ".idx"):  # the default cache beside the data, taken by a file
        shutil.copy(pattern_data + suffix, tmp_path / f"data{suffix}")
    (tmp_path / "cache").write_text("x")
    cfg = tiny_run(str(tmp_path / "data"), tmp_path / "run")
    cfg.data.cache_dir = None
    with pytest.raises(DataError, match=rf"^{tmp_path / 'cache'} \(the index cache beside "
                                        r"data.path's first prefix; data.cache_dir sets another\)"
                                        r": cannot be created \(File exists: "):
        build_datasets(cfg)


def test_a_run_reading_a_split_more_than_once_says_so(tmp_path, pattern_data, caplog):
    """Before: silent (megatron-core's "total number of epochs" is an INFO line megaloop hides)."""
    import logging

    from megaloop.training.data import build_datasets
    from tests.training.conftest import tiny_run

    small = _write(tmp_path / "small")  # 50 documents, 1,841 tokens
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        build_datasets(tiny_run(small, tmp_path / "run", train=dict(train_steps=1000)))
    assert caplog.messages == [
        f"data: the run reads the train split of {small} over 70 epochs: 4,027 samples of "
        "model.seq_length=32 tokens from its 1,841 tokens",
        f"data: the run reads the valid split of {small} over 2 epochs: 13 samples of "
        "model.seq_length=32 tokens from its 213 tokens"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        build_datasets(tiny_run(pattern_data, tmp_path / "run"))  # 400 documents: read once
    assert caplog.messages == []


@pytest.mark.parametrize("setting", [dict(eval_iters=10**20), dict(train_steps=10**15)])
def test_samples_whose_indices_exceed_the_memory_are_refused_naming_the_setting(
        tmp_path, pattern_data, setting):
    """Before: megatron-core counted the epochs of 4e20 validation samples one by one (a Python
    loop: hours), exit 0 never reached and nothing said; the subprocess times out."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from tests.training.conftest import tiny_run; "
            "from megaloop.training.data import build_datasets; from megaloop.data import "
            "DataError\ntry:\n build_datasets(tiny_run(sys.argv[1], Path(sys.argv[2]), "
            f"train={setting!r}))\nexcept DataError as e:\n print(e)")
    result = subprocess.run([sys.executable, "-c", code, pattern_data, str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    (name, value), = setting.items()
    assert result.stdout.startswith(
        f"train.{name}={value}: x train.global_batch_size=4 is {4 * value:,} samples, whose "
        "indices megatron-core builds in memory: at least "), result.stdout + result.stderr
    assert result.stdout.count("\n") == 1 and "GiB of [" in result.stdout
