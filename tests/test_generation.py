"""Greedy decoding: every chosen token is the argmax of the full forward of the sequence before
it (checked by one teacher-forced forward), deterministic, stopping at EOS or max_new_tokens,
never choosing padding rows, at any test-time depth, with a swappable backend; the cached backend
(reference model and KV cache) chooses the tokens the uncached canonical one does."""

import pytest
import torch

import megaloop.api as ml
from megaloop.generation import Cached, FullForward, Generation, greedy_generate

PROMPT = [5, 17, 3, 99, 42, 8]


@pytest.fixture(scope="module")
def model(mcore):
    m = ml.build("tiny", arch="asymloop", iterations=2, num_layers=2, hidden_size=32,
                 ffn_hidden_size=64, num_attention_heads=2, vocab_size=128, seq_length=32,
                 init_std=0.5).eval()  # large weights: varied, confident argmaxes
    return m


def teacher_forced_argmax(model, prompt, generated, num_iterations=None):
    """argmax at each generated position from one forward of the whole final sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated]), num_iterations=num_iterations)[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(generated)].argmax(-1).tolist()


@pytest.mark.parametrize("depth", [None, 4])
def test_each_token_is_the_argmax_of_the_full_forward(model, depth):
    out = greedy_generate(FullForward(model, num_iterations=depth), PROMPT, 10, eos_id=None)
    assert len(out.tokens) == 10 and not out.stopped_at_eos
    assert len(set(out.tokens)) > 1
    assert out.tokens == teacher_forced_argmax(model, PROMPT, out.tokens, depth)
    again = greedy_generate(FullForward(model, num_iterations=depth), PROMPT, 10, eos_id=None)
    assert again == out


def test_test_time_depth_changes_the_continuation(model):
    shallow = greedy_generate(FullForward(model, num_iterations=1), PROMPT, 10, eos_id=None)
    deep = greedy_generate(FullForward(model, num_iterations=6), PROMPT, 10, eos_id=None)
    assert shallow.tokens != deep.tokens


def test_stops_at_eos_without_emitting_it(model):
    free = greedy_generate(FullForward(model), PROMPT, 8, eos_id=None).tokens
    eos = free[3]
    stop = free.index(eos)
    out = greedy_generate(FullForward(model), PROMPT, 8, eos_id=eos)
    assert out == Generation(free[:stop], True)
    assert greedy_generate(FullForward(model), PROMPT, 0, eos_id=eos) == Generation([], False)


def test_padding_rows_above_the_tokenizer_vocabulary_are_never_chosen(model):
    free = greedy_generate(FullForward(model), PROMPT, 10, eos_id=None).tokens
    limit = max(free)  # the largest id chosen so far becomes out of vocabulary
    limited = greedy_generate(FullForward(model), PROMPT, 10, eos_id=None, vocab_size=limit)
    assert max(limited.tokens) < limit
    with torch.no_grad():
        first = model(torch.tensor([PROMPT]))[0, -1]
    assert limited.tokens[0] == int(first[:limit].argmax())


class Scripted:
    """A backend that replays fixed logits: the interface a cached backend implements."""
    context = 100

    def __init__(self, rows):
        self.rows, self.calls = [torch.tensor(r, dtype=torch.float) for r in rows], []

    def prefill(self, prompt):
        self.calls.append(("prefill", list(prompt)))
        return self.rows[0]

    def extend(self, token):
        self.calls.append(("extend", token))
        return self.rows[len(self.calls) - 1]


def test_backend_protocol_and_ties_go_to_the_lowest_id():
    backend = Scripted([[0, 3, 3, 1], [5, 0, 0, 0], [0, 0, 1, 9]])
    out = greedy_generate(backend, [7, 7], 5, eos_id=3)
    assert out == Generation([1, 0], True)
    assert backend.calls == [("prefill", [7, 7]), ("extend", 1), ("extend", 0)]
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        greedy_generate(backend, [7], -1, eos_id=None)


def test_decoding_past_the_trained_context_is_refused(model):
    """Before: any length was decoded, past the model's seq_length=32 without a word."""
    from megaloop.models.export import to_reference

    for backend in (FullForward(model), Cached(to_reference(model))):
        assert backend.context == 32
        assert len(greedy_generate(backend, PROMPT, 32 - len(PROMPT), eos_id=None).tokens) == 26
        with pytest.raises(ValueError) as error:
            greedy_generate(backend, PROMPT, 27, eos_id=None)
        assert str(error.value) == (
            "a prompt of 6 tokens and max_new_tokens=27 run past the model's 32-token context "
            "(model.seq_length, the length it was trained on); generate at most 26 tokens")


def test_the_model_call_takes_positions_past_its_context(model):
    """Its positions are RoPE, computed for any length (no position table to run out of): the
    model call is not refused past seq_length, and a causal prefix's logits do not change."""
    tokens = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        longer, prefix = model(tokens), model(tokens[:, :32])
    assert longer.shape == (1, 40, 128) and bool(torch.isfinite(longer).all())
    torch.testing.assert_close(longer[:, :32], prefix)


@pytest.mark.parametrize("max_new_tokens", [3, 0])  # 0: refused too, not an empty Generation
def test_empty_prompt_is_refused(model, max_new_tokens):
    with pytest.raises(ValueError, match="empty prompt"):
        greedy_generate(FullForward(model), [], max_new_tokens, eos_id=None)


@pytest.mark.parametrize("arch, depth", [("asymloop", None), ("asymloop", 4), ("fullloop", 3),
                                         ("latentloop", None)])  # LatentLoop: no other depth
def test_cached_decoding_chooses_the_canonical_tokens(mcore, arch, depth):
    from megaloop.models.export import to_reference

    canonical = ml.build("tiny", arch=arch, iterations=2, num_layers=3, hidden_size=32,
                         ffn_hidden_size=64, num_attention_heads=2, vocab_size=128,
                         seq_length=32, init_std=0.5).eval()
    reference = to_reference(canonical)
    expected = greedy_generate(FullForward(canonical, depth), PROMPT, 12, eos_id=None)
    cached = Cached(reference, depth)
    assert greedy_generate(cached, PROMPT, 12, eos_id=None) == expected
    assert len(set(expected.tokens)) > 1
    assert cached.cache.seen == len(PROMPT) + 11  # one token fed per step after the prompt
    # The backend starts a fresh cache per prompt: a second prompt decodes as if alone.
    other = PROMPT[::-1]
    assert greedy_generate(cached, other, 6, eos_id=None) == greedy_generate(
        FullForward(canonical, depth), other, 6, eos_id=None)
    with pytest.raises(ValueError, match="empty prompt"):
        cached.prefill([])
