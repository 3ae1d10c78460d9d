import os
import shutil

import numpy
import pytest
import torch

from megaloop.data.datasets import DatasetTokenizer, build_gpt_datasets, parse_blend
from megaloop.data.readers import DataError

TOKENIZER = DatasetTokenizer(vocab_size=32000, eod=2, name="llama2_tokenizer.model")


def _tokens(dataset, n=5):
    return [dataset[i]["tokens"].tolist() for i in range(n)]


def test_splits_samples_and_deterministic_shuffle(tmp_path, tokenized_articles):
    kwargs = dict(split="90,8,2", cache_dir=str(tmp_path / "cache"))
    train, valid, test = build_gpt_datasets([tokenized_articles], TOKENIZER, 64, (200, 20, None), **kwargs)
    assert len(train) >= 200 and len(valid) >= 20 and len(test) > 0
    sample = train[0]
    assert sample["tokens"].shape == (64,) and sample["labels"].shape == (64,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # labels are the next tokens
    again = build_gpt_datasets([tokenized_articles], TOKENIZER, 64, (200, 20, None), **kwargs)[0]
    assert _tokens(train) == _tokens(again)
    other_seed = build_gpt_datasets([tokenized_articles], TOKENIZER, 64, (200, 20, None), seed=7, **kwargs)[0]
    assert _tokens(train) != _tokens(other_seed)
    assert not [f for f in os.listdir(tmp_path / "cache") if ".tmp-" in f]


def test_eod_mask_loss(tmp_path, tokenized_articles):
    train = build_gpt_datasets([tokenized_articles], TOKENIZER, 4096, (None, None, None), split="100,0,0",
                               eod_mask_loss=True, cache_dir=str(tmp_path))[0]
    sample = train[0]
    eod = sample["tokens"] == TOKENIZER.eod
    assert eod.any()
    assert (sample["loss_mask"][eod] == 0).all() and (sample["loss_mask"][~eod] == 1).all()


def test_split_with_no_documents_is_refused(tmp_path, tokenized_articles):
    with pytest.raises(DataError, match=f"{tokenized_articles}: split '99,1,0.01' gives the test split 0 of its 62 documents"):
        build_gpt_datasets([tokenized_articles], TOKENIZER, 64, (10, 10, 10), split="99,1,0.01", cache_dir=str(tmp_path))


@pytest.mark.timeout(120)  # megatron-core looped forever on such a split
def test_an_empty_split_is_refused_even_when_no_samples_are_drawn_from_it(tmp_path,
                                                                         tokenized_articles):
    with pytest.raises(DataError, match=(
            f"^{tokenized_articles}: split '969,30,1' gives the test split \\(which this run draws "
            "no samples from\\) 0 of its 62 documents and no tokens, which megatron-core cannot "
            "build; use more data or a split such as '970,30,0'$")):
        build_gpt_datasets([tokenized_articles], TOKENIZER, 64, (10, 10, 0), split="969,30,1",
                           cache_dir=str(tmp_path))
    train, valid, test = build_gpt_datasets([tokenized_articles], TOKENIZER, 64, (10, 10, 0),
                                            split="970,30,0", cache_dir=str(tmp_path))
    assert len(train) >= 10 and len(valid) >= 10 and test is None


@pytest.mark.parametrize("split", ["-1,2", "90;10", "1,2,3,4", "1e2"])
def test_a_malformed_split_is_refused(tmp_path, tokenized_articles, split):
    # Before: megatron-core read the digits it found ("-1,2" as 1,2; "90;10" as 9010; "1e2", which
    # float() reads as 100, as 1,2) and built.
    with pytest.raises(DataError, match=f"^split '{split}': must be up to three non-negative "
                                        "decimal numbers train,valid,test with train > 0"):
        build_gpt_datasets([tokenized_articles], TOKENIZER, 64, (10, 10, 0), split=split,
                           cache_dir=str(tmp_path))


def test_corrupt_dataset_is_refused_naming_the_file(tmp_path, tokenized_articles):
    prefix = str(tmp_path / "copy")
    shutil.copy(tokenized_articles + ".idx", prefix + ".idx")
    with open(tokenized_articles + ".bin", "rb") as src, open(prefix + ".bin", "wb") as dst:
        dst.write(src.read()[:1000])
    with pytest.raises(DataError, match=f"{prefix}.bin: 1000 bytes, shorter than"):
        build_gpt_datasets([prefix], TOKENIZER, 64, (10, None, None), cache_dir=str(tmp_path))
    big_vocab = DatasetTokenizer(vocab_size=128256, eod=2, name="llama3")
    with pytest.raises(DataError, match="holds ids up to 65535"):
        build_gpt_datasets([tokenized_articles], big_vocab, 64, (10, None, None), cache_dir=str(tmp_path))


def test_weighted_blend_draws_from_both(tmp_path, tokenized_articles, mcore):
    other = str(tmp_path / "other")
    for suffix in (".bin", ".idx"):
        shutil.copy(tokenized_articles + suffix, other + suffix)
    train = build_gpt_datasets(["0.25", tokenized_articles, "0.75", other], TOKENIZER, 64, (400, 0, 0),
                               split="100,0,0", cache_dir=str(tmp_path / "cache"))[0]
    counts = numpy.bincount(numpy.asarray(train.dataset_index), minlength=2)
    assert counts.sum() == len(train) and abs(counts[0] / counts.sum() - 0.25) < 0.02


def test_a_corrupt_cached_blend_index_is_one_line_naming_it(tmp_path, tokenized_articles, mcore):
    """Before: numpy's ValueError naming no file, and on several ranks a hang (the others in
    megatron-core's next barrier); megaloop's own names of the blend's cache files are kept."""
    other = str(tmp_path / "other")
    for suffix in (".bin", ".idx"):
        shutil.copy(tokenized_articles + suffix, other + suffix)

    def build():
        return build_gpt_datasets(["0.25", tokenized_articles, "0.75", other], TOKENIZER, 64,
                                  (400, 0, 0), split="100,0,0", cache_dir=str(tmp_path / "cache"))[0]

    expected = numpy.asarray(build().dataset_index)
    [index] = (tmp_path / "cache").glob("*-BlendedDataset-train-dataset_index.npy")
    os.truncate(index, index.stat().st_size // 2)
    with pytest.raises(DataError) as error:
        build()
    assert str(error.value) == (f"{index}: corrupt (mmap length is greater than file size); "
                                "delete it, and the next run builds it again")
    index.unlink()
    assert numpy.array_equal(numpy.asarray(build().dataset_index), expected)


def test_weighted_blend_needs_every_split_size(tokenized_articles):
    with pytest.raises(DataError, match="sample count for every split"):
        build_gpt_datasets(["1", tokenized_articles], TOKENIZER, 64, (10, None, None))


def test_blend_parsing():
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    for weight in ("-1", "nan", "inf", "0"):  # before: nan and inf were taken as weights
        with pytest.raises(DataError, match=f"weight '{weight}' of 'a' is not a finite positive"):
            parse_blend([weight, "a", "2", "b"])
    # Before: two datasets, the repeated one drawn from twice as often.
    with pytest.raises(DataError, match="'a' is given twice, which draws from it twice as often; "
                                        "give it once, with a larger weight"):
        parse_blend(["1", "a", "2", "b", "1", "a"])

