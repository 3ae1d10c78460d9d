"""Maps the canonical megatron-core LoopedLM onto the plain-PyTorch reference model.

This is the weight mapping the Hugging Face export builds on and the one the parity tests exercise.
It works on a full (tensor-parallel size 1) state dict.
"""

from __future__ import annotations

import re

import torch

from megaloop.config import ModelConfig
from megaloop.models.export_moe_latent import (latent_reference_config, latent_reference_names,
                                               moe_reference_weights, moe_reference_fields,
                                               split_latent_state_dict)
from megaloop.reference.modeling_asymloop import LoopedLM as ReferenceLM
from megaloop.reference.modeling_asymloop import ReferenceConfig

_TOP_LEVEL = {
    "embedding.word_embeddings.weight": "embed_tokens.weight",
    "final_layernorm.weight": "norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# Per-layer names that map one to one (suffix after "<block>.layers.<i>.").
_LAYER_RENAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "pre_mlp_layernorm.weight": "mlp_norm.weight",
    # Transformer Engine fuses the pre-norms into the next linear (TE spec checkpoints).
    "self_attention.linear_qkv.layer_norm_weight": "attn_norm.weight",
    "self_attention.linear_q.layer_norm_weight": "attn_norm.weight",
    "mlp.linear_fc1.layer_norm_weight": "mlp_norm.weight",
    "self_attention.linear_proj.weight": "attn.o_proj.weight",
    "self_attention.linear_proj.linear.weight": "attn.o_proj.weight",
    "self_attention.linear_proj.norm.weight": "attn_norm.weight",  # OLMo post-norm
    "self_attention.linear_q.weight": "attn.q_proj.weight",
    "self_attention.q_layernorm.weight": "attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "attn.k_norm.weight",
    "self_attention.global_kv_layernorm.weight": "attn.global_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.linear.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.norm.weight": "mlp_norm.weight",  # OLMo post-norm
}
_LAYER = re.compile(r"^(encoder|decoder|coda|visit\d+)\.layers\.(\d+)\.(.+)$")


def reference_config(cfg: ModelConfig) -> ReferenceConfig:
    cfg.resolve()
    return ReferenceConfig(
        arch=cfg.arch, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, decoder_ffn_hidden_size=cfg.decoder_ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        vocab_size=cfg.vocab_size, encoder_layers=cfg.num_encoder_layers,
        iterations=cfg.iterations, block=cfg.block, qk_norm=cfg.qk_norm, injection=cfg.injection,
        local_kv=cfg.local_kv, global_kv_norm=cfg.global_kv_norm, rotary_base=cfg.rotary_base,
        norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings, kv_channels=cfg.kv_channels,
        **moe_reference_fields(cfg),
    )


def _split_qkv(weight: torch.Tensor, cfg: ModelConfig):
    """megatron-core interleaves rows per query group: [q heads of g; k_g; v_g] for each group g."""
    groups, hd, h = cfg.num_query_groups, cfg.kv_channels, cfg.hidden_size
    per_group = cfg.num_attention_heads // groups
    w = weight.view(groups, (per_group + 2) * hd, h)
    q, k, v = w.split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def _split_global_kv(weight: torch.Tensor, cfg: ModelConfig):
    w = weight.view(cfg.num_query_groups, 2 * cfg.kv_channels, cfg.hidden_size)
    k, v = w.split(cfg.kv_channels, dim=1)
    return k.reshape(-1, cfg.hidden_size), v.reshape(-1, cfg.hidden_size)


def to_reference_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """Renames and splits a megatron-core LoopedLM state dict into the reference model's keys."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("_extra_state"):
            continue
        if name in _TOP_LEVEL:
            out[_TOP_LEVEL[name]] = tensor
            continue
        match = _LAYER.match(name)
        if match is None:
            raise KeyError(f"unmapped megatron-core parameter {name}")
        block, index, suffix = match.groups()
        prefix = f"{block}.{index}."
        if suffix in _LAYER_RENAMES:
            out[prefix + _LAYER_RENAMES[suffix]] = tensor
        elif suffix == "self_attention.linear_qkv.weight":
            for part, w in zip("qkv", _split_qkv(tensor, cfg)):
                out[f"{prefix}attn.{part}_proj.weight"] = w
        elif suffix == "self_attention.linear_kv_global.weight":
            for part, w in zip("kv", _split_global_kv(tensor, cfg)):
                out[f"{prefix}attn.global_{part}_proj.weight"] = w
        elif suffix == "mlp.linear_fc1.weight":  # [gate; up]: the activation applies to the first
            gate, up = tensor.chunk(2, dim=0)
            out[prefix + "mlp.gate_proj.weight"] = gate
            out[prefix + "mlp.up_proj.weight"] = up
        elif (moe := moe_reference_weights(suffix, tensor)) is not None:
            out.update({prefix + key: value for key, value in moe.items()})
        else:
            raise KeyError(f"unmapped megatron-core parameter {name}")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def to_reference(model) -> ReferenceLM:
    """A reference model carrying a (TP=1) megatron-core LoopedLM's weights, in fp32."""
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    if model.cfg.arch == "latentloop":
        return _to_latent_reference(state, model.cfg)
    reference = ReferenceLM(reference_config(model.cfg))
    reference.load_state_dict(to_reference_state_dict(state, model.cfg), strict=True)
    return reference


def _to_latent_reference(state: dict, cfg: ModelConfig):
    from megaloop.reference.modeling_latentloop import LatentLoopLM

    reference = LatentLoopLM(latent_reference_config(cfg, vars(reference_config(cfg))))
    reference.load_state_dict(to_latent_reference_state_dict(state, cfg), strict=True)
    return reference


def to_latent_reference_state_dict(state_dict: dict, cfg: ModelConfig) -> dict:
    """A LatentLoop state dict (or its gradients) in the reference LatentLoopLM's names."""
    layers, own = split_latent_state_dict(state_dict, cfg)
    return {**latent_reference_names(to_reference_state_dict(layers, cfg)), **own}
