"""The plain-PyTorch reference model matches the megatron-core model: logits and gradients, fp32."""

import dataclasses

import pytest
import torch

from megaloop.models.export import reference_state_dict, to_reference
from megaloop.models.model import build_model
from tests.models.variants import ALL_VARIANTS, small_config


def _perturb_norms(model):
    """Norm weights start at 1; perturb them so that a swapped or missing norm cannot hide."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("variant", list(ALL_VARIANTS))
def test_reference_matches_megatron_core(seeded, variant):
    # MoE auxiliary losses are training terms of the canonical model: its logits (in training
    # mode, where the routers attach them, with large coefficients) do not include them, and
    # without them its gradients are the cross-entropy's alone, like the reference's.
    cfg = small_config(variant)
    model = build_model(cfg if not cfg.num_experts else dataclasses.replace(
        cfg, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.5)).train()
    _perturb_norms(model)
    reference = to_reference(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)

    logits = model(x)
    ref_logits = reference(x).logits
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    if cfg.num_experts:
        plain = build_model(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0,
                                                moe_z_loss_coeff=0.0)).train()
        plain.load_state_dict(model.state_dict())
        model = plain

    model(x, labels=labels).mean().backward()
    torch.nn.functional.cross_entropy(reference(x).logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    expected = reference_state_dict(grads, cfg)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(expected[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("variant", [name for name, fields in ALL_VARIANTS.items()
                                     if fields["arch"] in ("fullloop", "asymloop")])
def test_reference_test_time_depth_matches(seeded, variant):
    """Every looped variant (LatentLoop runs only its own visits) at depths below, at and above
    the trained one: what lm-eval's --depths and generate(num_iterations=) compute."""
    cfg = small_config(variant)
    model = build_model(cfg)
    _perturb_norms(model)
    reference = to_reference(model)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    with torch.no_grad():
        for depth in (1, cfg.iterations + 1, 6):
            torch.testing.assert_close(model(x, num_iterations=depth),
                                       reference(x, num_iterations=depth).logits, atol=1e-5,
                                       rtol=1e-5, msg=lambda m: f"depth {depth}: {m}")


def test_reference_refuses_test_time_depth_on_dense_as_the_canonical_model_does(seeded):
    cfg = small_config("dense")
    model = build_model(cfg)
    reference = to_reference(model)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x, num_iterations=1).logits,
                                   atol=1e-5, rtol=1e-5)
    for net in (model, reference):
        with pytest.raises(ValueError, match="num_iterations=3: arch=dense has no depth to vary"):
            net(x, num_iterations=3)


@pytest.mark.parametrize("arch", ["dense", "latentloop", "asymloop"])
def test_reference_keeps_the_canonical_test_time_depth_rule(seeded, arch):
    """The reference (remote code, its own copy of the rule) refuses exactly the depths
    ModelConfig.depth_refusal refuses, with the canonical model's message."""
    cfg = small_config(arch)
    model = build_model(cfg)
    reference = to_reference(model)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    for depth in (0, 1, 2, 3):
        problem = cfg.depth_refusal(depth)
        for net in (model, reference):
            if problem is None:
                with torch.no_grad():
                    net(x, num_iterations=depth)
            else:
                with pytest.raises(ValueError) as error:
                    net(x, num_iterations=depth)
                assert str(error.value) == f"num_iterations={depth}: {problem}"


@pytest.mark.parametrize("variant", ["latentloop", "latentloop_stride3_lag1",
                                     "latentloop_stride4_both_olmo", "latentloop_moe_untied_v3"])
def test_latentloop_reference_matches_at_every_length(seeded, variant):
    """Lengths 1..seq_length, most ending in an incomplete group of k tokens (which no latent
    holds yet): the inference lengths lm-eval and generation feed, beside training's multiples."""
    cfg = small_config(variant)
    model = build_model(cfg).eval()
    _perturb_norms(model)
    reference = to_reference(model)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    with torch.no_grad():
        for n in range(1, cfg.seq_length + 1):
            torch.testing.assert_close(model(x[:, :n]), reference(x[:, :n], use_cache=False).logits,
                                       atol=1e-5, rtol=1e-5, msg=lambda m: f"length {n}: {m}")
