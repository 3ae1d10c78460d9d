"""lm-eval's loglikelihood of a request does not depend on the batch it is scored in: HFLM pads
each batch on the right to its longest request (without an attention mask), so a padding token
that reached a real position (LatentLoop pairing it with a real token, MoE routing, the Global
or Local KV) would move the scores of the shorter requests, by an amount that looks plausible."""

import pytest
import torch

from megaloop.models.export import reference_class, reference_config
from tests.data.conftest import SHARED_DATA
from tests.hf.exports import perturb_norms
from tests.models.variants import ALL_VARIANTS, small_config

CONTEXT = 24
# Right padding meets every way a position can see another: LatentLoop's groups (all of them),
# MoE routing in each architecture, AsymLoop's Global KV alone and joined with the Local KV.
VARIANTS = ["dense", "fullloop_moe", "asymloop", "asymloop_no_local_kv", "asymloop_moe"] + \
    [name for name, fields in ALL_VARIANTS.items() if fields["arch"] == "latentloop"]


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    path = SHARED_DATA / "gpt2_tokenizer.json"
    if not path.is_file():
        pytest.skip(f"{path} not available")
    from transformers import PreTrainedTokenizerFast

    from megaloop.hf.evaluate import quiet_harness

    quiet_harness()
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def _requests(vocab: int):
    """(key, context ids, continuation ids) of odd and even lengths, two sharing a context
    (lm-eval scores their one-token continuations from one row), one cut to the context."""
    g = torch.Generator().manual_seed(7)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    requests = [((f"c{i}", ""), ids(c), ids(n)) for i, (c, n) in
                enumerate([(1, 1), (2, 3), (3, 1), (5, 4), (8, 2), (11, 5), (14, 1), (19, 3)])]
    shared = ids(6)
    requests += [(("shared", "a"), shared, [1]), (("shared", "b"), shared, [2]),
                 (("long", ""), ids(CONTEXT + 9), ids(2))]
    return requests


def _alone(model, context, continuation) -> float:
    """The continuation's log-probability from a forward over the request alone (its last
    CONTEXT + 1 tokens less the last, as lm-eval cuts it)."""
    ids = torch.tensor([(context + continuation)[-(CONTEXT + 1):][:-1]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
    return float(logprobs[-len(continuation):].gather(1, torch.tensor(continuation)[:, None]).sum())


@pytest.mark.parametrize("variant", VARIANTS)
def test_loglikelihood_is_the_requests_own_at_any_batch_size(tokenizer, variant):
    from megaloop.hf.evaluate import harness_model

    torch.manual_seed(0)
    cfg = small_config(variant, seq_length=CONTEXT)
    model = reference_class(cfg)(reference_config(cfg)).eval()
    perturb_norms(model)
    requests = _requests(cfg.vocab_size)
    expected = [_alone(model, context, continuation) for _, context, continuation in requests]
    for batch_size in (1, 4, len(requests)):
        lm = harness_model(model, tokenizer, batch_size=batch_size)
        scores = [score for score, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]
        assert scores == pytest.approx(expected, abs=2e-5), f"batch size {batch_size}"


def _dense_model_and_text():
    """A small dense reference model and a 12-token text to split at several points."""
    torch.manual_seed(0)
    cfg = small_config("dense", seq_length=CONTEXT)
    model = reference_class(cfg)(reference_config(cfg)).eval()
    perturb_norms(model)
    text = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    return cfg, model, text.tolist()


def test_requests_splitting_one_text_apart_get_their_own_scores(tokenizer):
    """Two requests whose context + continuation[:-1] are the same tokens, split at different
    points (Winogrande's twin sentences can be; rolling windows of repeated text are): lm-eval
    0.4.13 scores them from one forward and reads the shorter continuation from the leading
    positions of the longer one's logits, a plausible, wrong score (here off by 0.1 to 0.4)."""
    from megaloop.hf.evaluate import harness_model

    cfg, model, text = _dense_model_and_text()
    requests = [(("split", str(at)), text[:at], text[at:]) for at in (3, 8, 11)]
    expected = [_alone(model, context, continuation) for _, context, continuation in requests]
    for batch_size in (1, 3):
        lm = harness_model(model, tokenizer, batch_size=batch_size)
        scores = [score for score, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]
        assert scores == pytest.approx(expected, abs=2e-5), f"batch size {batch_size}"


def test_split_twins_among_other_requests_keep_their_places_and_the_grouping_stays(tokenizer):
    """The twins scored apart come back in the requests' order with their own scores, each
    request's answer is the one handed to the caching hook, and the one-token choices of one
    context (a multiple-choice task) are still scored from one row: the grouping is kept."""
    from megaloop.hf.evaluate import harness_model

    cfg, model, text = _dense_model_and_text()
    others = _requests(cfg.vocab_size)
    requests = (others[:4] + [(("split", str(at)), text[:at], text[at:]) for at in (3, 8)]
                + others[4:] + [(("split", "3b"), text[:3], text[3:])])
    expected = [_alone(model, context, continuation) for _, context, continuation in requests]
    rows, forward = [], model.forward
    model.forward = lambda ids, *args, **kwargs: rows.append(len(ids)) or forward(ids, *args,
                                                                                   **kwargs)
    lm = harness_model(model, tokenizer, batch_size=len(requests))
    hooked = []
    lm.cache_hook.add_partial = lambda kind, key, answer: hooked.append((key, answer))
    answers = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [score for score, _ in answers] == pytest.approx(expected, abs=2e-5)
    assert sorted(hooked, key=str) == sorted(zip([r[0] for r in requests], answers), key=str)
    # the split twins: 3 rows, one each; the rest: one row less than requests ("shared" a, b)
    assert sum(rows) == 3 + (len(others) - 1)
