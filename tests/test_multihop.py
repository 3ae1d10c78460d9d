"""The quickstart's multi-hop task: programs, hop counts, corpus, encoding and answer scoring."""

import collections
import json
import random

import pytest
import torch

from megaloop import multihop
from megaloop.multihop import Encoded, Program


def test_follow_counts_one_hop_per_binding_read():
    bindings = [("a", "4"), ("b", "7"), ("c", "a"), ("d", "c"), ("e", "b")]
    assert multihop.follow(bindings, "a") == ("4", 1)
    assert multihop.follow(bindings, "d") == ("4", 3)
    assert multihop.follow(bindings, "e") == ("7", 2)
    with pytest.raises(ValueError, match="'z' is not bound"):
        multihop.follow(bindings, "z")
    with pytest.raises(ValueError, match="cycle"):
        multihop.follow([("a", "b"), ("b", "a")], "a")


def test_program_text_prompt_and_answer():
    program = Program((("d", "4"), ("a", "7"), ("g", "d"), ("c", "a"), ("e", "g")), query="e")
    assert program.prompt == "d=4;a=7;g=d;c=a;e=g;?e="
    assert program.text == "d=4;a=7;g=d;c=a;e=g;?e=4"
    assert (program.answer, program.hops) == ("4", 3)


@pytest.mark.parametrize("hops,distractor", [(1, 1), (3, 2), (5, 3), (4, 4)])
def test_programs_have_the_requested_chains(hops, distractor):
    rng = random.Random(hops * 10 + distractor)
    for _ in range(30):
        program = multihop.make_program(rng, hops, distractor)
        names = [name for name, _ in program.bindings]
        assert len(names) == len(set(names)) == hops + distractor
        assert program.hops == hops
        digits = [value for _, value in program.bindings if value.isdigit()]
        assert len(digits) == len(set(digits)) == 2  # one head per chain, distinct
        bound = set()
        for name, value in program.bindings:  # every name is read after it is bound
            assert value.isdigit() or value in bound
            bound.add(name)
        heads = {multihop.follow(program.bindings, n)[0] for n in names}
        assert heads == set(digits)  # two chains, each resolving to its own digit
        assert (multihop.follow(program.bindings, program.query)[1] == hops
                and program.answer in digits)


@pytest.mark.parametrize("hops,distractor", [(0, 1), (1, 0), (5, 4)])
def test_impossible_programs_are_refused(hops, distractor):
    with pytest.raises(ValueError, match=f"hops={hops}, distractor_hops={distractor}"):
        multihop.make_program(random.Random(0), hops, distractor)


def test_program_count_is_how_many_distinct_programs_are_written():
    rng = random.Random(0)  # 150k draws find each of 10080 programs (coupon collector: ~93k)
    seen = {multihop.make_program(rng, 1, 1).prompt for _ in range(150_000)}
    assert len(seen) == multihop.program_count(1, 1) == 10080
    assert multihop.program_count(1, 2) == 10080 + 90720  # one set per distractor length
    assert multihop.program_count(7, 2) == multihop.program_count(7, 1)  # 7 + 2 names: too many


def test_training_hops_are_uniform_over_the_range():
    programs = multihop.training_programs(random.Random(0), 3000, max_hops=3)
    counts = collections.Counter(p.hops for p in programs)
    assert set(counts) == {1, 2, 3}
    assert all(900 < c < 1100 for c in counts.values()), counts
    distractors = collections.Counter(len(p.bindings) - p.hops for p in programs)
    assert set(distractors) == {1, 2, 3}


def test_corpus_is_deterministic_and_lists_its_prompts(tmp_path):
    first = multihop.write_corpus(tmp_path / "a.jsonl", 20, max_hops=3, seed=5)
    second = multihop.write_corpus(tmp_path / "b.jsonl", 20, max_hops=3, seed=5)
    other = multihop.write_corpus(tmp_path / "c.jsonl", 20, max_hops=3, seed=6)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert first == second and first != other
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(lines) == 20 and not list(tmp_path.glob("*.tmp"))
    texts = [text for line in lines for text in line["text"].split("\n")]
    assert 4 * 20 <= len(texts) <= 8 * 20
    assert {text[:text.index("?") + 3] for text in texts} == first


def test_an_interrupted_corpus_write_leaves_no_file(tmp_path, monkeypatch):
    # Before: a Ctrl-C mid-write left a.jsonl.tmp behind.
    programs = multihop.training_programs
    calls = iter(range(100))

    def interrupted(*args):
        if next(calls) == 2:
            raise KeyboardInterrupt
        return programs(*args)

    monkeypatch.setattr(multihop, "training_programs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        multihop.write_corpus(tmp_path / "a.jsonl", 5, max_hops=3)
    assert list(tmp_path.iterdir()) == []


def test_held_out_programs_skip_training_prompts():
    seen = {p.prompt for p in multihop.training_programs(random.Random(0), 5000, max_hops=3)}
    held_out = multihop.held_out_programs(1, [1, 2, 5], 50, 3, seen)
    assert [p.hops for p in held_out] == [1] * 50 + [2] * 50 + [5] * 50
    prompts = [p.prompt for p in held_out]
    assert len(set(prompts)) == 150 and not set(prompts) & seen
    assert held_out == multihop.held_out_programs(1, [1, 2, 5], 50, 3, seen)  # deterministic


def test_held_out_programs_say_when_too_few_are_unseen(monkeypatch):
    monkeypatch.setattr(multihop, "NAMES", "ab")
    monkeypatch.setattr(multihop, "DIGITS", "01")
    # 2 name orders x 2 digit orders x 2 interleavings: 8 distinct one-hop programs
    assert len(multihop.held_out_programs(0, [1], 8, 1, set())) == 8
    with pytest.raises(ValueError, match="hops=1: fewer than 9 programs unseen"):
        multihop.held_out_programs(0, [1], 9, 1, set())


class CharTokenizer:
    """One id per character (a stand-in for SentencePiece), optionally merging one pair."""

    def __init__(self, merge: str | None = None):
        self.merge = merge

    def encode_batch(self, texts):
        out = []
        for text in texts:
            ids, i = [], 0
            while i < len(text):
                if self.merge and text.startswith(self.merge, i):
                    ids.append(1000)
                    i += len(self.merge)
                else:
                    ids.append(ord(text[i]))
                    i += 1
            out.append(ids)
        return out


def test_encoding_splits_prompt_and_answer():
    program = Program((("a", "4"), ("b", "7"), ("c", "a")), query="c")
    (encoded,) = multihop.encode_programs(CharTokenizer(), [program])
    assert encoded.prompt == [ord(ch) for ch in program.prompt]
    assert encoded.answer == [ord("4")] and encoded.hops == 2
    with pytest.raises(ValueError, match="does not split it after the query"):
        multihop.encode_programs(CharTokenizer(merge="=4"), [program])


def test_every_binding_and_query_is_one_sentencepiece_token(tmp_path):
    from megaloop.data.tokenizer import SentencePieceTextTokenizer
    from megaloop.data.tokenizer_training import train_sentencepiece

    programs = multihop.training_programs(random.Random(0), 300, max_hops=3)
    train_sentencepiece([p.text for p in programs], tmp_path / "t.model", vocab_size=512,
                        hard_vocab_limit=False, special_tokens=multihop.task_pieces())
    tokenizer = SentencePieceTextTokenizer(tmp_path / "t.model")
    held_out = multihop.held_out_programs(1, [1, 4], 20, 3, set())
    for program, encoded in zip(held_out, multihop.encode_programs(tokenizer, held_out)):
        # the line's leading SentencePiece space, one token per binding, the query, the digit
        assert len(encoded.prompt) == 1 + len(program.bindings) + 1
        assert tokenizer.decode(encoded.answer) == program.answer
        assert len(encoded.answer) == 1


def _logits(length: int, winners: dict[int, int], vocab: int = 12) -> torch.Tensor:
    """Logits [1, length, vocab] whose argmax at each position in ``winners`` is that id (id 0
    elsewhere)."""
    logits = torch.zeros(1, length, vocab)
    logits[0, :, 0] = 1.0
    for position, token in winners.items():
        logits[0, position, token] = 5.0
    return logits


def test_answer_is_read_at_the_last_prompt_position():
    example = Encoded(prompt=[3, 4, 5], answer=[7], hops=1)
    assert multihop.answers_correct(_logits(4, {2: 7}), [example]) == [True]
    assert multihop.answers_correct(_logits(4, {3: 7}), [example]) == [False]  # one late
    assert multihop.answers_correct(_logits(4, {1: 7}), [example]) == [False]  # one early


def test_multi_token_answers_need_every_token():
    example = Encoded(prompt=[3, 4], answer=[7, 8], hops=2)
    assert multihop.answers_correct(_logits(4, {1: 7, 2: 8}), [example]) == [True]
    assert multihop.answers_correct(_logits(4, {1: 7, 2: 9}), [example]) == [False]
    assert multihop.answers_correct(_logits(4, {1: 9, 2: 8}), [example]) == [False]


def test_padding_rows_of_the_vocabulary_are_never_predicted():
    example = Encoded(prompt=[3], answer=[7], hops=1)
    logits = _logits(2, {0: 7})
    logits[0, 0, 11] = 9.0  # an id past the tokenizer's vocabulary wins the raw argmax
    assert multihop.answers_correct(logits, [example]) == [False]
    assert multihop.answers_correct(logits, [example], vocab_size=10) == [True]


class EchoModel(torch.nn.Module):
    """Predicts the token it reads ("the next token repeats this one"), adding one to the id at
    each iteration beyond the first; records the depths it was asked for."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.vocab, self.depths = vocab, []
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, num_iterations=None):
        self.depths.append(num_iterations)
        shift = (num_iterations or 1) - 1
        return torch.nn.functional.one_hot((ids + shift) % self.vocab, self.vocab).float()


def test_score_batches_right_padded_sequences_at_a_test_time_depth():
    examples = [Encoded([2, 5], [5], 1), Encoded([2, 3, 4, 6], [6], 2), Encoded([6], [1], 3),
                Encoded([1, 2], [3], 1)]
    model = EchoModel()
    one_batch = multihop.score(model, examples, num_iterations=None, vocab_size=16, pad_id=0)
    assert one_batch == [True, True, False, False]
    singles = multihop.score(model, examples, num_iterations=None, vocab_size=16, pad_id=9,
                             batch_size=1)
    assert singles == one_batch
    assert multihop.score(model, examples, num_iterations=2, vocab_size=16,
                          pad_id=0) == [False, False, False, True]
    assert model.depths[-1] == 2
    assert multihop.accuracy_by_hops(examples, one_batch) == {1: 0.5, 2: 1.0, 3: 0.0}
