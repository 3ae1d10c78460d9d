"""Cached generation of the reference (Hugging Face) models: chunked prefill gives the logits of one
full forward, greedy generate() gives the same tokens with and without the cache, test-time depth
at load time and per call, left padding (LatentLoop too), beam search over LatentLoop's cached
state."""

import re
import warnings

import pytest
import torch

from megaloop.models.export import reference_class, reference_config
from megaloop.reference.modeling_asymloop import CACHE_ARGUMENT
from tests.models.variants import small_config

CACHED_VARIANTS = ["dense", "fullloop", "asymloop", "asymloop_olmo", "asymloop_additive",
                   "asymloop_no_local_kv", "asymloop_no_global_kv", "asymloop_moe", "latentloop",
                   "latentloop_stride3_lag1", "latentloop_stride4_both_olmo",
                   "latentloop_moe_untied_v3", "latentloop_moe_topk", "latentloop_moe_width",
                   "latentloop_moe_expert_ffn", "moe_loop"]


def reference_model(variant, **overrides):
    """A reference model with perturbed norm weights (they start at 1), in eval mode."""
    torch.manual_seed(0)
    cfg = small_config(variant, **overrides)
    model = reference_class(cfg)(reference_config(cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def tokens(batch=2, length=13, vocab=128, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", CACHED_VARIANTS)
def test_chunked_prefill_gives_the_logits_of_a_full_forward(variant):
    """Chunks of 5, 1, 4 and 3 tokens: the 1-token chunk is a decode step; LatentLoop's groups of k
    tokens straddle the chunk boundaries."""
    model = reference_model(variant)
    x = tokens()
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = model.new_cache()
        chunks = [model(x[:, a:b], cache=cache).logits
                  for a, b in [(0, 5), (5, 6), (6, 10), (10, 13)]]
    assert cache.get_seq_length() == 13
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", ["asymloop", "latentloop_stride3_lag1",
                                     "latentloop_moe_untied_v3", "latentloop_moe_width"])
def test_greedy_generate_is_the_same_with_and_without_cache(variant):
    model = reference_model(variant)
    prompt = tokens(batch=1, length=7)
    cached = model.generate(prompt, max_new_tokens=9, do_sample=False)
    uncached = model.generate(prompt, max_new_tokens=9, do_sample=False, use_cache=False)
    assert cached.shape == (1, 16)
    assert torch.equal(cached, uncached)
    chunked = model.generate(prompt, max_new_tokens=9, do_sample=False, prefill_chunk_size=3,
                             **{CACHE_ARGUMENT: model.new_cache()})
    assert torch.equal(chunked, cached)
    # No cache passed in: generate() is given one (before: "Cannot use prefill chunking without
    # a cache", as transformers makes none for a model with its own cache class)
    assert torch.equal(model.generate(prompt, max_new_tokens=9, do_sample=False,
                                      prefill_chunk_size=3), cached)


def test_beam_search_reorders_latentloop_cached_state():
    """Beam search reorders the cache rows; LatentLoop's pending tokens and latent updates are
    cache state beyond keys/values and must follow them."""
    model = reference_model("latentloop_stride3_lag1")
    prompt = tokens(batch=1, length=5)
    kwargs = dict(max_new_tokens=7, do_sample=False, num_beams=3)
    assert torch.equal(model.generate(prompt, **kwargs),
                       model.generate(prompt, use_cache=False, **kwargs))


def test_depth_set_at_load_time_or_per_call():
    deep = reference_model("asymloop", iterations=5)
    default = reference_model("asymloop")  # same weights, iterations=3
    x = tokens(batch=1, length=6)
    with torch.no_grad():
        torch.testing.assert_close(default(x, num_iterations=5).logits, deep(x).logits)
        assert not torch.allclose(default(x).logits, deep(x).logits)
    assert torch.equal(default.generate(x, max_new_tokens=4, do_sample=False, num_iterations=5),
                       deep.generate(x, max_new_tokens=4, do_sample=False))
    cache = default.new_cache()
    default(x, cache=cache)
    with pytest.raises(ValueError, match="filled with 3 iterations; this call runs 5"):
        default(x[:, :1], cache=cache, num_iterations=5)
    # An empty cache takes the call's depth (before: "filled with 3 iterations ... start a new
    # cache", of the new cache that the documented chunked prefill passes).
    assert torch.equal(default.generate(x, max_new_tokens=4, do_sample=False, num_iterations=5,
                                        prefill_chunk_size=2,
                                        **{CACHE_ARGUMENT: default.new_cache()}),
                       deep.generate(x, max_new_tokens=4, do_sample=False))
    # An empty cache made for a depth keeps it: before, new_cache(5) ran the call's 3 unsaid.
    with pytest.raises(ValueError, match=r"^the cache was made for 5 iterations; this call runs 3"):
        default.generate(x, max_new_tokens=4, **{CACHE_ARGUMENT: default.new_cache(5)})
    assert torch.equal(default.generate(x, max_new_tokens=4, do_sample=False, num_iterations=5,
                                        **{CACHE_ARGUMENT: default.new_cache(5)}),
                       deep.generate(x, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv", "asymloop_moe",
                                     "fullloop_moe", "dense_moe_shared"])
def test_left_padding_gives_each_row_its_unpadded_logits(variant):
    """Padding keys hidden from the Global KV alone or joined with the Local KV; padding tokens
    routed through the experts take nothing from a token (no capacity)."""
    model = reference_model(variant)
    short, long = tokens(batch=1, length=4, seed=2), tokens(batch=1, length=7, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        torch.testing.assert_close(padded[0, 3:], model(short).logits[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(padded[1], model(long).logits[0], atol=2e-6, rtol=1e-5)
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False)
    alone = model.generate(short, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated[0, 3:], alone[0])


@pytest.mark.parametrize("variant", ["latentloop", "latentloop_stride3_lag1",
                                     "latentloop_stride4_both_olmo", "latentloop_moe_width"])
def test_latentloop_left_padding_gives_each_row_its_unpadded_logits_and_tokens(variant):
    """Rows padded by 0, 1, 2 and 5 tokens, which shift their groups of k tokens against each
    other: each row's logits (one forward, or a cached prefill in chunks) and greedy tokens are
    those of the row alone (lm-eval's batched generation pads on the left)."""
    model = reference_model(variant)
    lengths = [9, 8, 7, 4]
    rows = [tokens(batch=1, length=n, seed=10 + n)[0] for n in lengths]
    pads = [9 - n for n in lengths]
    batch = torch.stack([torch.cat([torch.zeros(p, dtype=torch.long), r]) for p, r in
                         zip(pads, rows)])
    mask = (torch.arange(9)[None] >= torch.tensor(pads)[:, None]).long()
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, use_cache=False).logits
        cache = model.new_cache()
        chunked = torch.cat([model(batch[:, a:b], attention_mask=mask[:, :b], cache=cache).logits
                             for a, b in [(0, 3), (3, 4), (4, 9)]], dim=1)
        for row, pad, in_batch, in_chunks in zip(rows, pads, padded, chunked):
            alone = model(row[None], use_cache=False).logits[0]
            torch.testing.assert_close(in_batch[pad:], alone, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(in_chunks[pad:], alone, atol=2e-6, rtol=1e-5)
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=7, do_sample=False)
    for row, pad, out in zip(rows, pads, generated):
        assert torch.equal(out[pad:], model.generate(row[None], max_new_tokens=7,
                                                     do_sample=False)[0])


def _reads_to_the_host(monkeypatch) -> list[str]:
    """Each tensor value taken to the host from now on (on a GPU, a sync that stalls the step)."""
    reads = []
    for method in ("__bool__", "__int__", "__float__", "item", "tolist"):
        def counted(self, *args, _original=getattr(torch.Tensor, method), _name=method):
            reads.append(_name)
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, method, counted)
    return reads


def test_latentloop_decodes_without_padding_reading_nothing_back_from_the_device(monkeypatch):
    """Without padding the decode steps (groups of k=3 completed at some, not others) take no
    value back from the device: every row's latent counts are the cache's. Left-padded rows count
    their own, read back once a step (the logits stay those of a full forward)."""
    model = reference_model("latentloop_stride3_lag1")
    x = tokens(length=11)
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    for attention_mask in (None, mask):
        with torch.no_grad():
            full = model(x, attention_mask=attention_mask, use_cache=False).logits
            cache = model.new_cache()
            steps = [model(x[:, :5], attention_mask=None if attention_mask is None else
                           attention_mask[:, :5], cache=cache).logits]
            with monkeypatch.context() as patch:
                reads = _reads_to_the_host(patch)
                for b in range(6, 12):
                    steps.append(model(x[:, b - 1:b], cache=cache, attention_mask=None if
                                       attention_mask is None else attention_mask[:, :b]).logits)
        assert (reads == []) == (attention_mask is None), reads
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", ["dense", "asymloop", "latentloop_stride3_lag1"])
def test_decoding_with_generates_attention_mask_reads_nothing_back_from_the_device(variant,
                                                                                   monkeypatch):
    """generate() passes an attention mask at every step: without padding in the prompt, the
    decode steps take no value of it back from the device (before: one read per generated
    token); a left-padded prompt still gives each row the logits of a full forward."""
    model = reference_model(variant)
    x = tokens(length=11)
    padded = torch.ones_like(x)
    padded[1, :2] = 0
    for mask in (torch.ones_like(x), padded):
        with torch.no_grad():
            full = model(x, attention_mask=mask, use_cache=False).logits
            cache = model.new_cache()
            steps = [model(x[:, :5], attention_mask=mask[:, :5], cache=cache).logits]
            with monkeypatch.context() as patch:
                reads = _reads_to_the_host(patch)
                for b in range(6, 12):
                    steps.append(model(x[:, b - 1:b], cache=cache,
                                       attention_mask=mask[:, :b]).logits)
        if mask is not padded or not variant.startswith("latentloop"):  # its rows count apart
            assert reads == [], reads
        kept = mask.bool()[:, :, None]
        torch.testing.assert_close(torch.cat(steps, dim=1) * kept, full * kept, atol=2e-6,
                                   rtol=1e-5)


def test_latentloop_refuses_padding_after_a_token_and_other_depths():
    model = reference_model("latentloop")
    x = tokens(batch=2, length=6)
    mask = torch.ones_like(x)
    mask[0, 3] = 0
    with pytest.raises(ValueError, match="takes left padding only"):
        model(x, attention_mask=mask)
    with pytest.raises(ValueError, match="runs exactly its iterations=2 visits"):
        model(x, num_iterations=3)


@pytest.mark.parametrize("depth", [2.5, "3", True])
def test_a_depth_per_call_that_is_no_integer_is_refused_naming_it(depth):
    """Before: a TypeError from range() in the model body (2.5), or from comparing a str with 1;
    True ran as depth 1."""
    model = reference_model("asymloop")
    with pytest.raises(ValueError, match=rf"^num_iterations={re.escape(repr(depth))}: must be an "
                                         "integer$"):
        model(tokens(batch=1, length=4), num_iterations=depth)


def test_forward_takes_old_transformers_cache_position_and_refuses_other_names():
    """cache_position is taken unnamed (transformers 5.24 warns about a forward naming it)."""
    model = reference_model("asymloop")
    x = tokens(batch=1, length=4)
    with torch.no_grad():
        torch.testing.assert_close(model(x, cache_position=torch.arange(4)).logits,
                                   model(x).logits)
        with pytest.raises(TypeError, match="unexpected keyword argument 'position_ids'"):
            model(x, position_ids=torch.arange(4)[None])


def _char_tokenizer(vocab: int):
    """A Hugging Face tokenizer whose ids are single characters (a..z first), decoded by joining
    them: what stop_strings needs to match decoded text."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import TokenizersBackend

    chars = list(string.ascii_lowercase) + [chr(0x100 + i) for i in range(vocab - 26)]
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    return TokenizersBackend(tokenizer_object=tokenizer), chars


def test_generate_stops_at_stop_strings_given_with_their_tokenizer():
    """generate(stop_strings=..., tokenizer=...) passes the tokenizer on to forward (before: a
    TypeError naming it, so stop strings could not be used)."""
    model = reference_model("asymloop")
    prompt = tokens(batch=1, length=5)
    tokenizer, chars = _char_tokenizer(128)
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    new = [chars[int(t)] for t in greedy[0, 5:]]
    stop = new[2]
    stopped = model.generate(prompt, max_new_tokens=6, do_sample=False, stop_strings=[stop],
                             tokenizer=tokenizer)
    assert torch.equal(stopped, greedy[:, :5 + new.index(stop) + 1])


def test_assisted_decoding_drops_rejected_draft_tokens_from_the_cache(monkeypatch):
    """Assisted decoding (a 1-iteration draft of the same weights) and prompt lookup crop the
    rejected draft tokens from the cache: the tokens are greedy decoding's (before: the cache kept
    counting them, a size mismatch at the next forward). A LatentLoop cache with compressed
    visits cannot drop tokens: one ValueError saying so."""
    from megaloop.reference.modeling_asymloop import LoopedCache

    dropped = []
    crop = LoopedCache.crop
    monkeypatch.setattr(LoopedCache, "crop", lambda self, n: (dropped.append(-n), crop(self, n)))
    model, draft = reference_model("asymloop"), reference_model("asymloop", iterations=1)
    prompt = torch.cat([tokens(batch=1, length=4)] * 2, dim=1)  # repeats: lookup candidates
    greedy = model.generate(prompt, max_new_tokens=8, do_sample=False)
    for kwargs in (dict(assistant_model=draft), dict(prompt_lookup_num_tokens=3)):
        dropped.clear()
        out = model.generate(prompt, max_new_tokens=8, do_sample=False,
                             **{CACHE_ARGUMENT: model.new_cache()}, **kwargs)
        assert torch.equal(out, greedy), kwargs
        assert max(dropped) > 0, kwargs  # some draft token was rejected
    latent = reference_model("latentloop")
    cache = latent.new_cache()
    latent(tokens(batch=1, length=5), cache=cache)
    with pytest.raises(ValueError, match="cannot drop tokens: it holds LatentLoop state"):
        cache.crop(-1)


def test_latentloop_refuses_another_number_of_visits_at_load_time(tmp_path):
    """from_pretrained(dir, iterations=N) sets a looped model's depth; a LatentLoop runs exactly
    its own visits. The MoE Loop's fixed scales are not in its weights, so nothing else noticed
    (before: 3 visits of a 2-visit model, without a word)."""
    model = reference_model("moe_loop")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^iterations=3: arch=latentloop runs exactly its "
                                         r"iterations=2 visits"):
        type(model).from_pretrained(tmp_path, iterations=3)
    x = tokens(batch=1, length=5)
    with torch.no_grad():
        torch.testing.assert_close(type(model).from_pretrained(tmp_path, iterations=2)(x).logits,
                                   model(x).logits)


def test_crop_takes_the_tokens_to_drop_or_before_transformers_5_24_the_tokens_to_keep(
        monkeypatch):
    """transformers 5.24 crops by minus the tokens to drop; earlier ones by the length to keep
    (their layers cut to it, as here). Either way the cache continues as if the dropped tokens
    had never been fed."""
    from transformers.cache_utils import DynamicLayer

    def cut_to(layer, length):  # what a layer of transformers before 5.24 does with length > 0
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]

    model, x = reference_model("asymloop"), tokens(batch=1, length=9)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        for crop in (-3, 6):
            if crop > 0:
                monkeypatch.setattr(DynamicLayer, "crop", cut_to)
            cache = model.new_cache()
            model(x, cache=cache)
            cache.crop(crop)
            assert cache.get_seq_length() == 6
            cache.crop(7 if crop > 0 else 0)  # a length it does not exceed, nothing: no change
            assert cache.get_seq_length() == 6
            torch.testing.assert_close(model(x[:, 6:], cache=cache).logits, full[:, 6:],
                                       atol=2e-6, rtol=1e-5)


def test_loss_is_normalised_by_num_items_in_batch_as_transformers_trainer_passes_it(tmp_path):
    """transformers' Trainer passes num_items_in_batch (forward takes **kwargs) and expects the
    summed loss over it; before, forward refused it, so Trainer fine-tuning failed at step 1."""
    pytest.importorskip("accelerate")
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    model = reference_model("asymloop")
    x = tokens(length=8)
    labels = x.clone()
    labels[0, :3] = -100
    predicted = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        mean = model(x, labels=labels).loss
        torch.testing.assert_close(model(x, labels=labels, num_items_in_batch=predicted).loss, mean)
        torch.testing.assert_close(
            model(x, labels=labels, num_items_in_batch=torch.tensor(2 * predicted)).loss, mean / 2)

    class Rows(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": x[i % 2], "labels": labels[i % 2]}

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1,
                             gradient_accumulation_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model.train(), args=args, train_dataset=Rows())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_assisted_decoding_without_a_cache_passed_in():
    """Assisted decoding and prompt lookup need a cache to crop, which generate() makes for no
    model with its own (before: "Assisted decoding requires a cache", naming no fix): given one,
    they give greedy decoding's tokens."""
    model, draft = reference_model("asymloop"), reference_model("asymloop", iterations=1)
    prompt = torch.cat([tokens(batch=1, length=4)] * 2, dim=1)
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    for kwargs in (dict(assistant_model=draft), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False, **kwargs),
                           greedy), kwargs


@pytest.mark.parametrize("variant", ["asymloop", "latentloop"])
def test_generate_warns_before_running_past_the_trained_context(variant):
    """max_position_embeddings (megaloop's seq_length) is the trained context: generate() says,
    before generating, that a prompt and max_new_tokens run past it (before: transformers' vague
    reminder once per process), and still generates them (RoPE positions are defined there). Up
    to the context: no warning."""
    model = reference_model(variant)
    context = model.config.max_position_embeddings
    prompt = tokens(batch=1, length=context - 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.generate(prompt, max_new_tokens=4, do_sample=False).shape[1] == context
    with pytest.warns(UserWarning, match=f"^a prompt of {context - 4} tokens .* and up to 6 new "
                      f"tokens run past the model's {context}-token context .*; generate at most "
                      "4 new tokens$"):
        assert model.generate(prompt, max_new_tokens=6, do_sample=False).shape[1] == context + 2


def test_the_context_warning_hooks_a_method_generate_still_calls(monkeypatch):
    """The warning above overrides GenerationMixin._validate_generated_length, a private method:
    no public hook sees generate()'s max_length (its arguments, the model's generation config
    and transformers' defaults merged) before the first token (a LogitsProcessor or
    StoppingCriteria sees the tokens so far, not the length asked for). Were it renamed or
    dropped in the installed transformers, generate() would no longer reach the override and
    the warning would be gone without an error: this test names the cause."""
    import transformers
    from transformers import GenerationMixin

    hook = vars(GenerationMixin).get("_validate_generated_length")
    assert hook is not None, (f"transformers {transformers.__version__} has no GenerationMixin."
                              "_validate_generated_length: move the reference models' context "
                              "warning to what generate() now calls with its max_length")
    calls = []

    def recorded(self, generation_config, input_ids_length, *args, **kwargs):
        calls.append((generation_config.max_length, input_ids_length))
        return hook(self, generation_config, input_ids_length, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_validate_generated_length", recorded)
    reference_model("asymloop").generate(tokens(batch=1, length=5), max_new_tokens=3,
                                         do_sample=False)
    assert calls == [(8, 5)], (f"transformers {transformers.__version__}'s generate() calls "
                               "_validate_generated_length otherwise than with (generation_config "
                               f"of the max_length asked for, the prompt's length): {calls}")
