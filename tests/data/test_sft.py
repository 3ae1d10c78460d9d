"""Fine-tuning samples: loss mask on solution tokens only, records read without losing any, splits
and seeded epoch order, over-long records, and the data.format=sft config guards."""

import logging

import pytest
import torch

from megaloop.config import ConfigError, DataConfig, RunConfig
from megaloop.data import DataError, load_tokenizer
from megaloop.data.sft import SFTDataset, build_sft_datasets, read_records, sft_sample, \
    split_bounds
from tests.sft import PROMPT, SOLUTION, arithmetic_records, train_tokenizer, write_jsonl


def test_sample_masks_prompt_and_padding_and_keeps_solution_and_closing_eod():
    eod = 2
    sample = sft_sample([5, 6, 7], [8, 9, eod], seq_length=10, pad_id=eod)
    assert sample["tokens"].tolist() == [5, 6, 7, 8, 9, 2, 2, 2, 2, 2]
    assert sample["labels"].tolist() == [6, 7, 8, 9, 2, 2, 2, 2, 2, 2]
    # Positions 2, 3, 4 predict 8, 9 and the EOD; 0-1 predict prompt tokens, 5.. padding.
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert sample["position_ids"].tolist() == list(range(10))
    exact = sft_sample([5], [8, eod], seq_length=2, pad_id=eod)  # fills the sequence exactly
    assert exact["loss_mask"].tolist() == [1, 1] and exact["labels"].tolist() == [8, eod]
    with pytest.raises(ValueError, match="do not fit"):
        sft_sample([5, 6], [8, eod], seq_length=2, pad_id=eod)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = train_tokenizer(tmp_path_factory.mktemp("tok") / "tok.model", arithmetic_records(50))
    return load_tokenizer("SentencePieceTokenizer", path)


def test_datasets_decode_to_prompt_and_solution_in_seeded_epoch_order(tmp_path, tokenizer):
    records = arithmetic_records(10)
    data = write_jsonl(tmp_path / "train.jsonl", records)
    train, valid, test = build_sft_datasets([str(data)], tokenizer, 64, (25, 4, 0), split="8,2,0",
                                            seed=3, prompt=PROMPT, solution=SOLUTION)
    assert test is None and len(train) == 25 and len(valid) == 4
    assert len(train.examples) == 8 and len(valid.examples) == 2  # records 0-7 | 8-9
    seen = []
    for i in range(len(train)):
        sample = train[i]
        mask = sample["loss_mask"].bool()
        first = int(mask.nonzero()[0])
        prompt = tokenizer.decode(sample["tokens"][:first + 1].tolist())
        solution = sample["labels"][mask].tolist()
        assert solution[-1] == tokenizer.eod and tokenizer.eod not in solution[:-1]
        index = [r["question"] for r in records].index(prompt.split("\n")[0][len("Question: "):])
        assert prompt == PROMPT.format_map(records[index])
        assert tokenizer.decode(solution[:-1]).strip() == records[index]["answer"]
        seen.append(index)
    for epoch in range(3):  # each epoch a permutation of the train records, in a new order
        assert sorted(seen[8 * epoch:8 * epoch + 8]) == list(range(8))
    assert seen[:8] != seen[8:16] and seen[:8] != list(range(8))
    assert set(seen[24:]) <= set(range(8))
    again = build_sft_datasets([str(data)], tokenizer, 64, (25, 4, 0), split="8,2,0", seed=3,
                               prompt=PROMPT, solution=SOLUTION)[0]
    other_seed = build_sft_datasets([str(data)], tokenizer, 64, (25, 4, 0), split="8,2,0",
                                    seed=4, prompt=PROMPT, solution=SOLUTION)[0]
    assert all(torch.equal(again[i]["tokens"], train[i]["tokens"]) for i in range(25))
    assert any(not torch.equal(other_seed[i]["tokens"], train[i]["tokens"]) for i in range(8))
    with pytest.raises(IndexError):
        train[25]


def test_split_bounds_round_like_megatron_core():
    assert split_bounds([6973, 500, 0], 7473) == [(0, 6973), (6973, 7473), (7473, 7473)]
    assert split_bounds([969, 30, 1], 10) == [(0, 10), (10, 10), (10, 10)]


def test_records_too_long_are_left_out_with_a_warning_and_none_fitting_is_an_error(
        tmp_path, tokenizer, caplog):
    records = arithmetic_records(6)
    records[2]["answer"] = "It is " + "many more apples, " * 20 + "\n#### 5"
    data = write_jsonl(tmp_path / "train.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="megaloop.data"):
        train = build_sft_datasets([str(data)], tokenizer, 64, (6, 0, 0), split="1", seed=0,
                                   prompt=PROMPT, solution=SOLUTION)[0]
    assert len(train.examples) == 5
    assert "1 of the 6 train records are longer than model.seq_length=64" in caplog.text
    with pytest.raises(DataError, match="none of the 6 records of the train split fits "
                                        "model.seq_length=8"):
        build_sft_datasets([str(data)], tokenizer, 8, (6, 0, 0), split="1", seed=0,
                           prompt=PROMPT, solution=SOLUTION)


def test_a_weighted_split_that_rounds_to_no_record_is_an_error(tmp_path, tokenizer):
    """GSM8K's data.split=6973,500,0 over 5 records: before, the valid split was silently empty
    and the run trained without any validation loss."""
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_records(5))
    with pytest.raises(DataError) as err:
        build_sft_datasets([str(data)], tokenizer, 64, (4, 2, 0), split="6973,500,0", seed=0,
                           prompt=PROMPT, solution=SOLUTION)
    assert str(err.value) == (f"{data}: data.split='6973,500,0' gives the valid split none of "
                              "the 5 records; give more records, or a split with a larger valid "
                              "share")
    # A split without validation weight, or one no sample is drawn from, stays as it was.
    for split, wanted in (("100,0,0", (4, 2, 0)), ("6973,500,0", (4, 0, 0))):
        assert build_sft_datasets([str(data)], tokenizer, 64, wanted, split=split, seed=0,
                                  prompt=PROMPT, solution=SOLUTION)[1] is None


def test_a_bad_record_is_an_error_naming_its_line(tmp_path, tokenizer):
    lines = write_jsonl(tmp_path / "a.jsonl", arithmetic_records(3)).read_text().splitlines()
    lines[1] = '{"question": "no answer here"}'
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"a.jsonl:2: missing key \('answer'\); every record "
                                        r"needs the fields question, answer"):
        read_records([str(tmp_path / "a.jsonl")], ("question", "answer"))
    (tmp_path / "b.txt").write_text("plain\n")
    with pytest.raises(DataError, match="b.txt: plain text has no fields"):
        read_records([str(tmp_path / "b.txt")], ("question",))
    with pytest.raises(DataError, match="blend weights are not taken by data.format=sft"):
        build_sft_datasets(["0.5", str(tmp_path / "a.jsonl")], tokenizer, 64, (1, 0, 0),
                           split="1", seed=0, prompt=PROMPT, solution=SOLUTION)


def test_a_list_or_an_empty_field_is_an_error_naming_its_line(tmp_path):
    # Before: taken; a list was formatted as its Python repr ("Question: ['a', 'b']"), and an
    # empty answer trained the model to stop right after the prompt.
    for line, detail in (('{"question": ["a", "b"], "answer": "1"}', "'question' is ['a', 'b']"),
                         ('{"question": "q", "answer": " "}', "'answer' is ' '")):
        (tmp_path / "a.jsonl").write_text('{"question": "q", "answer": "1"}\n' + line + "\n")
        with pytest.raises(DataError) as err:
            read_records([str(tmp_path / "a.jsonl")], ("question", "answer"))
        assert str(err.value) == (f"{tmp_path / 'a.jsonl'}:2: empty or non-string text ({detail}); "
                                  "every record needs the fields question, answer")


def test_dataset_needs_examples():
    with pytest.raises(ValueError, match="at least one example"):
        SFTDataset([], 8, 0, 1, 0, 0)


@pytest.mark.parametrize("fields, message", [
    (dict(tokenizer_model=None, eod_id=0), "data.tokenizer_model=None: must be given for "
                                           "data.format='sft'"),
    (dict(sft_prompt="Question: {}"), "data.sft_prompt='Question: {}': must be a format string"),
    (dict(sft_solution="{answer"), "data.sft_solution='{answer': must be a format string"),
    (dict(eod_mask_loss=True), "data.eod_mask_loss=True: must be false for data.format='sft'"),
    (dict(cache_dir="c"), "data.cache_dir='c': must be unset for data.format='sft'"),
    (dict(format="indexed"), "data.sft_prompt='Q: {q}': must be left at its default unless "
                             "data.format='sft'"),
])
def test_sft_config_mistakes_are_one_line_errors(fields, message):
    data = DataConfig(path=["d.jsonl"], format="sft", tokenizer_model="tok.model",
                      sft_prompt="Q: {q}", sft_solution="{a}")
    for name, value in fields.items():
        setattr(data, name, value)
    with pytest.raises(ConfigError) as error:
        RunConfig(data=data).validate()
    assert str(error.value).startswith(message)
