"""The architectures and ablations every model-level test runs over (small CPU sizes)."""

from megaloop.config import ModelConfig

SMALL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, vocab_size=128, seq_length=16)

VARIANTS = {
    "dense": dict(arch="dense", iterations=1),
    "dense_olmo": dict(arch="dense", iterations=1, block="olmo"),
    "fullloop": dict(arch="fullloop", iterations=2),
    "fullloop_olmo": dict(arch="fullloop", iterations=2, block="olmo"),
    "asymloop": dict(arch="asymloop", iterations=3),
    "asymloop_olmo": dict(arch="asymloop", iterations=3, block="olmo"),
    "asymloop_masked": dict(arch="asymloop", iterations=3, joint_attention="masked"),
    "asymloop_no_global_kv": dict(arch="asymloop", iterations=3, injection="none"),
    "asymloop_no_local_kv": dict(arch="asymloop", iterations=3, local_kv=False),
    "asymloop_no_qk_norm": dict(arch="asymloop", iterations=3, qk_norm=False),
    "asymloop_no_global_kv_norm": dict(arch="asymloop", iterations=3, global_kv_norm=False),
    "asymloop_additive": dict(arch="asymloop", iterations=3, injection="additive"),
    "asymloop_wide_ffn": dict(arch="asymloop", iterations=2, injection="none",
                              decoder_ffn_hidden_size=128),
    "asymloop_tied_gqa1": dict(arch="asymloop", iterations=2, tie_embeddings=True,
                               num_query_groups=1),
}

# MoE FFNs (megatron-core MoELayer) in every architecture; 4 experts, top-2.
MOE = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
MOE_VARIANTS = {
    "dense_moe_shared": dict(arch="dense", iterations=1, **MOE, moe_shared_expert_size=48),
    "fullloop_moe": dict(arch="fullloop", iterations=2, **MOE),
    "asymloop_moe": dict(arch="asymloop", iterations=3, **MOE),
    "asymloop_moe_decoder": dict(arch="asymloop", iterations=2, moe_layers="decoder", **MOE),
}
# LatentLoop (prelude 1, middle 2, coda 1 layers) and its switches; "moe_loop" is the MoE Loop
# baseline (symmetric visits, no compression).
LATENT_VARIANTS = {
    "latentloop": dict(arch="latentloop", iterations=2),
    "latentloop_moe": dict(arch="latentloop", iterations=2, **MOE),
    "latentloop_stride3_lag1": dict(arch="latentloop", iterations=2, latent_stride=3,
                                    latent_writeback_lag=1, seq_length=18),
    "latentloop_stride4_both_olmo": dict(arch="latentloop", iterations=2, latent_stride=4,
                                         latent_visits=[1, 2], block="olmo"),
    "latentloop_moe_untied_v3": dict(arch="latentloop", iterations=3, untie_attention=True,
                                     untie_moe=True, latent_visits=[2], residual_scale="fixed",
                                     residual_scale_init=[0.25, 1.0, 0.5], head_dim=20, **MOE),
    "latentloop_moe_topk": dict(arch="latentloop", iterations=2, num_experts=8, moe_top_k=4,
                                moe_ffn_hidden_size=16, latent_reduction="top_k"),
    # The other first-visit reductions: visit 1 (of 4) at width d/2 between learned projections
    # (the shared block narrowed, a shared expert too), and with experts of half their hidden units
    # (visits 2.. with attention of their own).
    "latentloop_moe_width": dict(arch="latentloop", iterations=4, latent_reduction="width",
                                 moe_shared_expert_size=16, **MOE),
    "latentloop_moe_expert_ffn": dict(arch="latentloop", iterations=2,
                                      latent_reduction="expert_ffn", moe_shared_expert_size=16,
                                      untie_attention=True, **MOE),
    "moe_loop": dict(arch="latentloop", iterations=2, latent_visits=[], residual_scale="fixed",
                     **MOE),
}
ALL_VARIANTS = {**VARIANTS, **MOE_VARIANTS, **LATENT_VARIANTS}


def small_config(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**SMALL, **ALL_VARIANTS[name], **overrides})


def assert_causal(model, tokens, t: int) -> None:
    """Changing token t changes no logit before t, and does change the logits from t on."""
    import torch

    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # MoE: an expert's GEMM has as many rows as tokens routed to it, so a later token's routing
    # changes the blocking and the last bits (~1e-7); a leak would move logits by orders more.
    exact = 1e-5 if model.cfg.uses_moe else 0
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=exact, rtol=0)
    assert (a[:, t:] - b[:, t:]).abs().max() > 0, "token t must influence its own logits"
