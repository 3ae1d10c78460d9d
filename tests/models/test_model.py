"""Behaviour of the canonical megatron-core LoopedLM that users rely on."""

import contextlib
import dataclasses

import pytest
import torch

from megaloop.config import ParallelConfig
from megaloop.models.flops import parameter_count
from megaloop.models.model import build_model
from tests.models.variants import ALL_VARIANTS, assert_causal, small_config


def _tokens(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)


@pytest.mark.parametrize("variant", list(ALL_VARIANTS))
def test_changing_token_t_changes_no_logit_before_t(seeded, variant):
    cfg = small_config(variant)
    assert_causal(build_model(cfg).eval(), _tokens(cfg), t=9)


@pytest.mark.parametrize("variant", list(ALL_VARIANTS))
def test_a_bf16_model_is_bf16_throughout(seeded, variant):
    """build_model(params_dtype=bf16) without Float16Module, as the step-time benchmark and the GPU
    check build it: every parameter is bf16, and forward and backward run in bf16. Before, the
    local spec's norms stayed fp32 and promoted their outputs, and the next bf16 matmul failed (on
    a GPU, every variant: "expected mat1 and mat2 to have the same dtype")."""
    cfg = small_config(variant)
    model = build_model(cfg, params_dtype=torch.bfloat16)
    assert {n: p.dtype for n, p in model.named_parameters() if p.dtype != torch.bfloat16} == {}
    x = _tokens(cfg)
    assert model(x).dtype == torch.bfloat16
    model(x, labels=x).float().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.bfloat16 and g.isfinite().all() for g in grads)


@pytest.mark.parametrize("variant", list(ALL_VARIANTS))
def test_parameter_count_matches_analytical_and_ignores_iterations(seeded, variant):
    cfg = small_config(variant)
    # (LatentLoop's visits carry their own scales: its count depends on the number of visits.)
    depths = (cfg.iterations,) if cfg.arch in ("dense", "latentloop") else (1, 2, 5)
    counts = {k: sum(p.numel() for p in build_model(dataclasses.replace(cfg, iterations=k))
                     .parameters())
              for k in depths}
    assert len(set(counts.values())) == 1, f"weights must be tied across iterations: {counts}"
    assert counts[depths[0]] == parameter_count(cfg)


@pytest.mark.parametrize("variant", ["fullloop", "asymloop", "asymloop_additive"])
def test_decoder_weight_gradient_is_the_sum_over_iterations(seeded, variant):
    """The tied decoder's fc2 weight is used K times; its gradient is the sum of K contributions."""
    cfg = small_config(variant, iterations=3)
    model = build_model(cfg)
    fc2 = model.decoder.layers[-1].mlp.linear_fc2
    inputs, grads = [], []
    fc2.register_forward_hook(lambda m, inp, out: inputs.append(inp[0].detach()))
    fc2.register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0].detach()))
    model(_tokens(cfg), labels=_tokens(cfg, seed=1)).sum().backward()
    assert len(inputs) == len(grads) == 3
    per_iteration = [torch.einsum("sbo,sbi->oi", g, x) for g, x in zip(reversed(grads), inputs)]
    torch.testing.assert_close(fc2.weight.grad, sum(per_iteration), atol=1e-5, rtol=1e-4)
    assert all(p.abs().sum() > 0 for p in per_iteration)


@pytest.mark.parametrize("iterations", [1, 3, 5])
@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv"])
def test_global_kv_is_projected_once_per_forward(seeded, variant, iterations):
    cfg = small_config(variant, iterations=iterations)
    model = build_model(cfg)
    calls = []
    for layer in model.decoder.layers:
        layer.self_attention.linear_kv_global.register_forward_hook(
            lambda m, i, o: calls.append(m))
    model(_tokens(cfg))
    assert len(calls) == cfg.num_decoder_layers
    assert len({id(m) for m in calls}) == cfg.num_decoder_layers


def test_test_time_depth_override(seeded):
    cfg = small_config("asymloop", iterations=3)
    model = build_model(cfg).eval()
    deeper = build_model(dataclasses.replace(cfg, iterations=5)).eval()
    deeper.load_state_dict(model.state_dict())
    x = _tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(x, num_iterations=5), deeper(x), atol=0, rtol=0)
        assert (model(x, num_iterations=5) - model(x)).abs().max() > 1e-6
    with pytest.raises(ValueError, match="num_iterations=0"):
        model(x, num_iterations=0)


@pytest.mark.parametrize("variant", ["asymloop", "fullloop_olmo"])
def test_full_recompute_gives_identical_loss_and_gradients(seeded, variant):
    cfg = small_config(variant)
    plain = build_model(cfg)
    recomputed = build_model(cfg, ParallelConfig(recompute="full"))
    recomputed.load_state_dict(plain.state_dict())
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    for m in (plain, recomputed):
        m(x, labels=labels).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_loss_is_per_token_cross_entropy(seeded):
    cfg = small_config("asymloop")
    model = build_model(cfg)
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    logits = model(x)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                 reduction="none").view_as(labels)
    torch.testing.assert_close(model(x, labels=labels), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_global_kv", "asymloop_additive"])
def test_decoder_starts_from_the_unnormalised_encoder_output(seeded, variant):
    """Design choice: z_0 = H_E as the encoder block leaves it (no final norm in between); the
    Global KV projections see it through their own RMSNorm. Additive injection starts from 0."""
    cfg = small_config(variant)
    model = build_model(cfg)
    seen = {}

    def encoder_out(module, inputs, output):
        seen["encoded"] = output

    def first_decoder_input(module, args, kwargs):
        seen.setdefault("z0", args[0] if args else kwargs["hidden_states"])

    model.encoder.register_forward_hook(encoder_out)
    model.decoder.register_forward_pre_hook(first_decoder_input, with_kwargs=True)
    model(_tokens(cfg))
    assert torch.equal(seen["z0"], seen["encoded"])  # additive: 0 + H_E on the first step


def test_a_dense_model_has_no_test_time_depth(seeded):
    cfg = small_config("dense")
    model = build_model(cfg).eval()
    x = _tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(x, num_iterations=1), model(x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="num_iterations=2: arch=dense has no depth to vary"):
        model(x, num_iterations=2)


@pytest.mark.parametrize("recipe", ["current", "delayed", "mxfp8"])
def test_fp8_on_the_local_spec_is_refused(seeded, recipe):
    """megatron-core's local modules accept the FP8 fields and compute in fp32 regardless."""
    with pytest.raises(ValueError, match=f"fp8='{recipe}': needs the Transformer Engine spec"):
        build_model(small_config("asymloop"), fp8=recipe, use_te=False)


@pytest.mark.parametrize("variant, parallel, message", [
    ("dense", dict(tensor=2), "parallel.tensor=2: megatron-core's tensor-parallel group has 1 "),
    ("asymloop_moe", dict(expert=2),
     "parallel.expert=2: megatron-core's expert-parallel group has 1 "),
])
def test_parallel_sizes_other_than_the_process_groups_are_refused(seeded, variant, parallel,
                                                                  message):
    """The layers split by megatron-core's groups (here all of size 1): a differing size would
    reach only the config, the model built whole."""
    with pytest.raises(ValueError, match=message):
        build_model(small_config(variant), ParallelConfig(**parallel))


@pytest.mark.parametrize("variant, dtype, cuda, noted", [
    ("asymloop", torch.float32, True, True),
    ("asymloop", torch.bfloat16, True, False),
    ("asymloop", torch.float32, False, False),
    ("asymloop_masked", torch.float32, True, False),
    ("asymloop_no_local_kv", torch.float32, True, False),
])
def test_fused_joint_attention_falling_back_in_fp32_on_cuda_is_noted(monkeypatch, caplog, variant,
                                                                    dtype, cuda, noted):
    from megaloop.models.model import note_fp32_joint_attention

    cfg = small_config(variant).resolve()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with caplog.at_level("WARNING", logger="megaloop.models"):
        note_fp32_joint_attention(cfg, dtype)
    assert ("runs the masked formula" in caplog.text) == noted


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_every_decoder_linear_runs_in_the_decoders_fp8_context(seeded, monkeypatch, recipe):
    """Under FP8 every linear of the encoder and decoder, the Global K/V projections included,
    runs inside megatron-core's FP8 context made from its block's config (recipe and amax
    reduction group): Transformer Engine computes a linear called outside one in bf16, as the
    Global K/V projection was, which LoopedLM runs outside the decoder block.

    Transformer Engine does not install here: its fp8_autocast is stood in for by a context
    recording the config it was made from, entered where megatron-core enters the real one
    (fp8_utils.get_fp8_context, as TransformerBlock calls it per block call for delayed scaling
    and per layer otherwise); the models are built without FP8 (refused without Transformer
    Engine) and their configs then switched to it."""
    from megatron.core import fp8_utils
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import transformer_block

    entered = []

    def fp8_context(config, layer_no=-1, is_init=False):
        @contextlib.contextmanager
        def recording():
            entered.append(config)
            try:
                yield
            finally:
                entered.pop()
        return recording() if config.fp8 else contextlib.nullcontext()

    monkeypatch.setattr(fp8_utils, "get_fp8_context", fp8_context)
    monkeypatch.setattr(transformer_block, "get_fp8_context", fp8_context)
    cfg = small_config("asymloop")
    model = build_model(cfg)
    blocks = {"encoder": model.encoder, "decoder": model.decoder}
    for block in blocks.values():
        block.config.fp8, block.config.fp8_recipe = "hybrid", recipe
    contexts = {}
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.register_forward_hook(
                lambda m, i, o, name=name: contexts.setdefault(name, []).append(
                    entered[-1] if entered else None))
    model(_tokens(cfg))
    linears = {name: calls for name, calls in contexts.items() if name.split(".")[0] in blocks}
    assert any("linear_kv_global" in name for name in linears)
    for name, calls in linears.items():
        config = blocks[name.split(".")[0]].config
        assert calls and all(call is config for call in calls), name
    assert contexts["output_layer"] == [None]  # megatron-core keeps the head out of FP8 too
