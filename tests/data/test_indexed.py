import os
import shutil

import numpy
import pytest

from megaloop.data.indexed import AtomicIndexedWriter, merge_indexed, validate_indexed
from megaloop.data.readers import DataError


def _write(prefix, docs, dtype=numpy.uint16):
    with AtomicIndexedWriter(str(prefix), dtype) as writer:
        for doc in docs:
            writer.add_document(numpy.array(doc), [len(doc)])
        writer.commit()
    return str(prefix)


def _copy(prefix, tmp_path, name):
    out = str(tmp_path / name)
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, out + suffix)
    return out


DOCS = [[5, 6, 7, 2], [8, 2], [9, 10, 11, 12, 2]]


def test_megatron_core_reads_what_the_writer_wrote(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = _write(tmp_path / "d", DOCS)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert validate_indexed(prefix, vocab_size=32000, scan_tokens=True).num_tokens == 11


def test_failed_write_leaves_no_files(tmp_path):
    with pytest.raises(RuntimeError):
        with AtomicIndexedWriter(str(tmp_path / "d"), numpy.uint16) as writer:
            writer.add_document(numpy.array([1, 2]), [2])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_truncated_or_corrupt_idx_names_the_file(tmp_path):
    prefix = _write(tmp_path / "d", DOCS)
    idx = prefix + ".idx"
    data = open(idx, "rb").read()
    open(idx, "wb").write(data[:-5])
    with pytest.raises(DataError, match=f"{idx}: size .* truncated or corrupt"):
        validate_indexed(prefix)
    open(idx, "wb").write(b"garbage" + data[7:])
    with pytest.raises(DataError, match=f"{idx}: not a Megatron .idx file"):
        validate_indexed(prefix)
    open(idx, "wb").write(data[:20])
    with pytest.raises(DataError, match=f"{idx}: not a Megatron .idx file"):
        validate_indexed(prefix)


def test_short_bin_and_mismatched_pair_name_the_bin(tmp_path):
    prefix = _write(tmp_path / "d", DOCS)
    bin_path = prefix + ".bin"
    with open(bin_path, "r+b") as f:
        f.truncate(os.path.getsize(bin_path) - 2)
    with pytest.raises(DataError, match=f"{bin_path}: 20 bytes, shorter than the 22 bytes its .idx describes"):
        validate_indexed(prefix)
    other = _write(tmp_path / "other", DOCS + [[1] * 50])
    shutil.copy(other + ".bin", bin_path)  # a .bin from another dataset
    with pytest.raises(DataError, match=f"{bin_path}: .* longer than"):
        validate_indexed(prefix)


def test_vocab_larger_than_the_dtype_or_ids_past_the_vocab(tmp_path):
    prefix = _write(tmp_path / "d", DOCS)
    with pytest.raises(DataError, match=f"{prefix}.bin: token dtype uint16 holds ids up to 65535, but the tokenizer has 128256 tokens"):
        validate_indexed(prefix, vocab_size=128256)
    with pytest.raises(DataError, match=f"{prefix}.bin: token id 12 is outside the tokenizer's 10-token vocab"):
        validate_indexed(prefix, vocab_size=10, scan_tokens=True)


def test_missing_half_of_a_pair(tmp_path):
    prefix = _write(tmp_path / "d", DOCS)
    os.remove(prefix + ".bin")
    with pytest.raises(DataError, match=f"{prefix}.bin: not found"):
        validate_indexed(prefix)


def test_a_prefix_given_as_a_file_or_as_the_output_prefix_names_the_dataset_meant(tmp_path):
    # Before: only "<prefix>.idx: not found", though the data was beside it under another name.
    prefix = _write(tmp_path / "fwe_text_document", DOCS)
    for given in (prefix + ".bin", prefix + ".idx"):
        with pytest.raises(DataError) as err:
            validate_indexed(given)
        assert str(err.value) == (f"{given}.idx: not found (a dataset prefix needs both .bin and "
                                  f".idx); a prefix names the files without .bin/.idx: {prefix}")
    with pytest.raises(DataError) as err:
        validate_indexed(str(tmp_path / "fwe"))
    assert str(err.value).endswith(f"; tools/preprocess_data.py --output-prefix {tmp_path / 'fwe'} "
                                   f"writes {prefix}")
    with pytest.raises(DataError) as err:
        validate_indexed(str(tmp_path / "other"))
    assert str(err.value).endswith("not found (a dataset prefix needs both .bin and .idx)")


def test_merge_concatenates_in_order_and_can_stop_early(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    a = _write(tmp_path / "a", DOCS)
    b = _write(tmp_path / "b", [[100, 101], [102]])
    whole = _write(tmp_path / "whole", DOCS + [[100, 101], [102]])
    assert merge_indexed([a, b], str(tmp_path / "m")) == 5
    for suffix in (".bin", ".idx"):
        assert open(str(tmp_path / "m") + suffix, "rb").read() == open(whole + suffix, "rb").read()
    assert merge_indexed([a, b], str(tmp_path / "cut"), max_docs=4) == 4
    ds = IndexedDataset(str(tmp_path / "cut"))
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS + [[100, 101]]
    wide = _write(tmp_path / "wide", DOCS, dtype=numpy.int32)
    with pytest.raises(DataError, match="different token dtypes"):
        merge_indexed([a, wide], str(tmp_path / "bad"))


def test_flat_documents_with_sentences_and_empty_ones_survive_a_cut_merge(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Documents: empty, two sequences [1 2] [3 4 5], empty; then [6] [7] in one document.
    with AtomicIndexedWriter(str(tmp_path / "a"), numpy.uint16) as writer:
        writer.add_documents(numpy.arange(1, 6), numpy.array([2, 3]), numpy.array([0, 2, 0]))
        writer.add_documents(numpy.array([6, 7]), numpy.array([1, 1]), numpy.array([2]))
        writer.commit()
    ds = IndexedDataset(str(tmp_path / "a"))
    assert ds.document_indices.tolist() == [0, 0, 2, 2, 4]
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3, 4, 5], [6], [7]]
    b = _write(tmp_path / "b", [[9]])
    for cut, sequences, tokens in ((1, 0, 0), (3, 2, 5)):  # merging stops inside the first part
        assert merge_indexed([str(tmp_path / "a"), b], str(tmp_path / f"m{cut}"), max_docs=cut) == cut
        summary = validate_indexed(str(tmp_path / f"m{cut}"))
        assert (summary.num_documents, summary.num_sequences, summary.num_tokens) == (cut, sequences, tokens)


def test_a_replacement_cut_between_its_renames_leaves_no_pair_that_validates(tmp_path, monkeypatch):
    # Before: the new .bin beside the old .idx, which validates when their sizes agree (the same
    # token count in other documents) and reads the new tokens at the old boundaries.
    prefix = _write(tmp_path / "d", DOCS)
    real_replace, renamed = os.replace, []

    def killed_before_the_idx(src, dst):
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt
        renamed.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_the_idx)
    with pytest.raises(KeyboardInterrupt):
        _write(prefix, [[5, 6], [7, 2, 8, 2, 9, 10, 11], [12, 2]])  # 11 tokens again
    assert renamed == [prefix + ".bin"]
    with pytest.raises(DataError, match=r"\.idx: not found"):
        validate_indexed(prefix)


def test_the_token_sample_sees_a_changed_block_and_reads_a_large_bin_in_part(tmp_path,
                                                                            monkeypatch):
    import builtins

    from megaloop.data import indexed

    prefix = str(tmp_path / "d")
    tokens = numpy.random.default_rng(0).integers(0, 1000, 3 << 20, dtype=numpy.uint16)  # 6 MiB
    tokens.tofile(indexed.bin_path(prefix))
    before = indexed.bin_sample_md5(prefix)
    read = []

    class Counting:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def read(self, *size):
            data = self.file.read(*size)
            read.append(len(data))
            return data

    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    assert indexed.bin_sample_md5(prefix) == before  # the same bytes: the same digest
    monkeypatch.setattr(builtins, "open", real_open)
    assert sum(read) == indexed.SAMPLE_BLOCKS * indexed.SAMPLE_BLOCK_BYTES
    # In the first block, one between (the blocks start at k/15 of the bytes before the last
    # block's) and the last.
    between = (tokens.nbytes - indexed.SAMPLE_BLOCK_BYTES) * 7 // 15 // 2 + 100
    for position in (0, between, tokens.size - 1):
        changed = tokens.copy()
        changed[position] += 1
        changed.tofile(indexed.bin_path(prefix))
        assert indexed.bin_sample_md5(prefix) != before, position
    tokens[:-1].tofile(indexed.bin_path(prefix))  # one token fewer
    assert indexed.bin_sample_md5(prefix) != before
