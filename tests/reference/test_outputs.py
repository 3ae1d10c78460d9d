"""transformers' output flags on the reference (Hugging Face) models: ``output_hidden_states`` gives
the residual stream after each layer as the model unrolls it (forward and generate); the attention
weights, which the model does not keep, are refused in one line; ``output_scores`` /
``output_logits`` are the forward's logits."""

import pytest
import torch

from tests.reference.test_generation import reference_model, tokens


@pytest.mark.parametrize("variant, count", [
    ("dense", 1 + 4),  # embeddings + each layer, as transformers' Llama
    ("asymloop", 1 + 2 + 3 * 2),  # E = 2, D = 2, K = 3: every iteration's layers
    ("asymloop_additive", 1 + 2 + 3 * 2),
    ("latentloop_stride3_lag1", 1 + 1 + 2 + 1),  # prelude, each visit, coda
])
def test_hidden_states_are_the_unrolled_residual_stream(variant, count):
    model = reference_model(variant)
    x = tokens()
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
        plain = model(x).logits
        chunked = [model(x[:, a:b], cache=cache, output_hidden_states=True).hidden_states
                   for cache in [model.new_cache()] for a, b in [(0, 6), (6, 13)]]
    states = out.hidden_states
    assert len(states) == count, [s.shape for s in states]
    assert all(s.shape == (2, 13, model.config.hidden_size) for s in states)
    torch.testing.assert_close(states[0], model.embed_tokens(x))
    # the last is the final norm's output, which the head reads
    torch.testing.assert_close(model.lm_head(states[-1]), out.logits)
    torch.testing.assert_close(out.logits, plain)
    # cached calls give the new tokens' states: a prompt in two chunks, those of one forward
    for i, state in enumerate(states):
        torch.testing.assert_close(torch.cat([c[i] for c in chunked], dim=1), state,
                                   atol=2e-6, rtol=1e-5)


def test_hidden_states_of_one_iteration_begin_those_of_three():
    """The layers of iteration 1 run the same at any depth: one iteration's states are the first
    1 + E + D of three iterations' (its last, the final norm of that point)."""
    model = reference_model("asymloop")
    x = tokens()
    with torch.no_grad():
        one = model(x, num_iterations=1, output_hidden_states=True).hidden_states
        three = model(x, output_hidden_states=True).hidden_states
    assert len(one) == 1 + 2 + 2
    for a, b in zip(one[:-1], three):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(one[-1], model.norm(three[len(one) - 1]))


@pytest.mark.parametrize("variant", ["asymloop", "latentloop"])
def test_generate_returns_hidden_states_per_step(variant):
    """Before: transformers' TypeError (forward() got an unexpected keyword argument
    'output_hidden_states')."""
    model = reference_model(variant)
    prompt = tokens(batch=1, length=7)
    out = model.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                         output_hidden_states=True, output_logits=True)
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=3, do_sample=False))
    assert [step[0].shape[1] for step in out.hidden_states] == [7, 1, 1]
    for step, logits in zip(out.hidden_states, out.logits):
        torch.testing.assert_close(model.lm_head(step[-1][:, -1]), logits)


@pytest.mark.parametrize("variant", ["asymloop", "latentloop"])
def test_generate_scores_and_logits_are_the_forward_logits(variant):
    model = reference_model(variant)
    prompt = tokens(batch=1, length=7)
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                         output_scores=True, output_logits=True)
    with torch.no_grad():
        full = model(out.sequences[:, :-1], use_cache=False).logits[:, 6:]
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(torch.stack(out.scores, dim=1), full, atol=2e-6, rtol=1e-5)


def test_attention_weights_are_refused_in_one_line():
    """Before: transformers' TypeError naming the argument (forward and generate)."""
    model = reference_model("asymloop")
    x = tokens(batch=1, length=5)
    calls = [lambda: model(x, output_attentions=True),
             lambda: model.generate(x, max_new_tokens=2, output_attentions=True,
                                    return_dict_in_generate=True)]
    for call in calls:
        with pytest.raises(ValueError, match=r"^output_attentions=True: not supported, this model "
                                             r"keeps no attention weights \(output_hidden_states"
                                             r"=True gives[^\n]*$"):
            call()
    model.config.output_attentions = True  # set in the config: named so
    with pytest.raises(ValueError, match=r"^model\.config\.output_attentions=True: not supported"):
        model(x)


def test_config_output_hidden_states_is_applied():
    model = reference_model("fullloop")
    model.config.output_hidden_states = True
    x = tokens(batch=1, length=5)
    assert len(model(x).hidden_states) == 1 + 4 * 2
    assert model(x, output_hidden_states=False).hidden_states is None
    with pytest.raises(ValueError, match=r"^output_hidden_states=\[1\]: pass True or False"):
        model(x, output_hidden_states=[1])


def test_config_return_dict_false_gives_a_tuple():
    """As transformers' models: before, ``config.return_dict = False`` was ignored."""
    model = reference_model("dense")
    x = tokens(batch=1, length=5)
    model.config.return_dict = False
    logits, cache = model(x)
    torch.testing.assert_close(logits, model(x, return_dict=True).logits)
    assert cache.get_seq_length() == 5
