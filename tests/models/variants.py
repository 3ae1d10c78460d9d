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


def small_config(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**SMALL, **VARIANTS[name], **overrides})


def assert_causal(model, tokens, t: int) -> None:
    """Changing token t changes no logit before t, and does change the logits from t on."""
    import torch

    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=0, rtol=0)
    assert (a[:, t:] - b[:, t:]).abs().max() > 0, "token t must influence its own logits"
