"""Mixtral / Qwen3-MoE <-> megaloop: the load-balancing coefficient is carried both ways, converted
between transformers' one loss over all layers' gates and megatron-core's loss per layer; the
remote-code models, which carry the coefficients without applying them, say so when trained."""

import logging

import pytest
import torch

from megaloop.hf.checkpoint import load_checkpoint_model
from megaloop.hf.from_hf import import_hf


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_router_coefficients_survive_a_round_trip(exports, variant, tmp_path, caplog):
    import json

    exported = exports.get(variant)
    cfg = exported.cfg  # 4 layers, top-2, moe_aux_loss_coeff 0.01
    config = json.loads((exported.hf_dir / "config.json").read_text())
    assert config["router_aux_loss_coef"] == pytest.approx(
        cfg.moe_aux_loss_coeff * cfg.num_layers / cfg.moe_top_k, rel=1e-12)
    caplog.clear()  # the export's warnings (the same line, and the z-loss it cannot carry)
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        import_hf(exported.hf_dir, tmp_path / "back")
    _, run, _ = load_checkpoint_model(tmp_path / "back")
    assert run.model.moe_aux_loss_coeff == pytest.approx(cfg.moe_aux_loss_coeff, rel=1e-12)
    assert run.model.moe_z_loss_coeff == 0.0  # neither class has a router z-loss
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"router_aux_loss_coef={config['router_aux_loss_coef']:g}" in warning
    assert f"model.moe_aux_loss_coeff={cfg.moe_aux_loss_coeff:g}" in warning


def test_imported_mixtral_trains_with_the_aux_loss_weight_transformers_applies(seeded):
    """The routers of a model built from an imported Mixtral config (3 layers, top-2, coefficient
    0.02) get, from their load-balancing losses, the gradient that transformers' loss gives the
    same gates (every layer routing the same tokens with the same weight)."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from megaloop.hf.native import model_config_from_native
    from megaloop.models import moe
    from megaloop.models.model import build_model

    hf = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, max_position_embeddings=16, sliding_window=None)
    model = build_model(model_config_from_native(hf)).train()
    routers = moe.routers(model)
    assert len(routers) == 3
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 32, generator=generator)
    hidden = torch.randn(24, 1, 32, generator=generator)

    for router in routers:
        router.weight.data.copy_(weight)
        probs, _ = router(hidden)
        (probs * 0).sum().backward()  # the load-balancing loss's gradient alone
    weights = [weight.clone().requires_grad_() for _ in routers]
    gates = tuple(torch.nn.functional.linear(hidden[:, 0], w) for w in weights)
    (hf.router_aux_loss_coef * load_balancing_loss_func(gates, 4, 2)).backward()
    for router, reference in zip(routers, weights):
        assert reference.grad.abs().max() > 0
        torch.testing.assert_close(router.weight.grad, reference.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("variant", ["asymloop_moe", "latentloop_moe"])
def test_a_remote_code_moe_model_says_once_that_its_training_loss_has_no_router_losses(
        seeded, variant):
    """Its config.json carries moe_aux_loss_coeff and moe_z_loss_coeff for megaloop; its loss
    is the cross-entropy alone. Before, fine-tuning it (transformers' Trainer) trained the routers
    without load balancing, unsaid. Evaluation and models without experts say nothing."""
    import warnings

    from megaloop.models.export import to_reference
    from megaloop.models.model import build_model
    from tests.models.variants import small_config

    def warned(model, train=True, grad=True):
        model.train(train)
        tokens = torch.randint(0, model.config.vocab_size, (1, 8))
        with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(grad):
            warnings.simplefilter("always")
            model(tokens, labels=tokens, use_cache=False)
        return [str(w.message) for w in caught if "router" in str(w.message)]

    moe = to_reference(build_model(small_config(variant)))
    assert warned(moe, train=False) == [] and warned(moe, grad=False) == []
    [message] = warned(moe)
    assert message.startswith("moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001 (config.json): "
                              "this model's loss is the cross-entropy alone")
    assert warned(moe) == []  # once per model
    dense = variant.removesuffix("_moe")
    assert warned(to_reference(build_model(small_config(dense)))) == []
