"""Maps the canonical megatron-core LoopedLM onto the plain-PyTorch reference model and back.

This is the weight mapping the Hugging Face export builds on and the one the parity tests exercise.
It works on a full (tensor-parallel size 1) state dict. The way back (``invert_mapping``)
is not a second mapping: it runs this one on element indices and scatters the reference tensors
through them, so the two directions cannot drift apart.

The reference modules import transformers (they are the Hugging Face models), so they are imported
where used: training never loads transformers.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from megaloop.config import ModelConfig
from megaloop.models.export_moe_latent import (latent_reference_fields, latent_reference_names,
                                               moe_reference_weights, moe_reference_fields,
                                               split_latent_state_dict)

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


def reference_config(cfg: ModelConfig):
    """The reference (Hugging Face) MegaloopConfig of a megaloop model config."""
    from megaloop.reference.configuration_megaloop import LatentLoopConfig, MegaloopConfig

    cfg = dataclasses.replace(cfg).resolve()
    config_class = LatentLoopConfig if cfg.arch == "latentloop" else MegaloopConfig
    return config_class(
        arch=cfg.arch, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, decoder_ffn_hidden_size=cfg.decoder_ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        head_dim=cfg.kv_channels, vocab_size=cfg.vocab_size,
        encoder_layers=cfg.num_encoder_layers, iterations=cfg.iterations, block=cfg.block,
        qk_norm=cfg.qk_norm, injection=cfg.injection, local_kv=cfg.local_kv,
        global_kv_norm=cfg.global_kv_norm, joint_attention=cfg.joint_attention,
        rotary_base=cfg.rotary_base, norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.seq_length,
        initializer_range=cfg.init_std, **moe_reference_fields(cfg),
        **latent_reference_fields(cfg),
    )


def model_config(reference) -> ModelConfig:
    """The megaloop ModelConfig of a reference (Hugging Face) MegaloopConfig: the inverse of
    ``reference_config`` up to derived defaults, which come back resolved (an explicit head_dim
    equal to the default comes back unset)."""
    arch = reference.arch
    fields = dict(
        arch=arch, num_layers=reference.num_layers, hidden_size=reference.hidden_size,
        ffn_hidden_size=reference.ffn_hidden_size,
        decoder_ffn_hidden_size=reference.decoder_ffn_hidden_size,
        num_attention_heads=reference.num_attention_heads,
        num_query_groups=reference.num_query_groups,
        head_dim=(None if reference.head_dim == reference.hidden_size // reference.num_attention_heads
                  else reference.head_dim),
        vocab_size=reference.vocab_size, seq_length=reference.max_position_embeddings,
        iterations=reference.iterations, block=reference.block, qk_norm=reference.qk_norm,
        rotary_base=float(reference.rotary_base), norm_eps=reference.norm_eps,
        init_std=reference.initializer_range, tie_embeddings=bool(reference.tie_word_embeddings),
        num_experts=reference.num_experts)
    if arch == "asymloop":
        fields.update(encoder_layers=reference.encoder_layers, injection=reference.injection,
                      local_kv=reference.local_kv, global_kv_norm=reference.global_kv_norm,
                      joint_attention=reference.joint_attention)
    if reference.num_experts:
        fields.update(moe_layers=reference.moe_layers, moe_top_k=reference.moe_top_k,
                      moe_ffn_hidden_size=reference.moe_ffn_hidden_size,
                      moe_shared_expert_size=reference.moe_shared_expert_size,
                      moe_aux_loss_coeff=reference.moe_aux_loss_coeff,
                      moe_z_loss_coeff=reference.moe_z_loss_coeff)
    if arch == "latentloop":
        fields.update({name: getattr(reference, name) for name in latent_reference_fields(
            ModelConfig(arch="latentloop"))})
    return ModelConfig(**fields).resolve()


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
    """Renames and splits a megatron-core LoopedLM state dict into the reference model's keys.
    Part of one maps to its part (a conversion maps a layer at a time); the tied head comes with
    the embedding."""
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
    if cfg.tie_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def reference_class(cfg: ModelConfig):
    """The reference model class of ``cfg.arch``."""
    if cfg.arch == "latentloop":
        from megaloop.reference.modeling_latentloop import LatentLoopLM

        return LatentLoopLM
    from megaloop.reference.modeling_asymloop import LoopedLM

    return LoopedLM


def reference_state_dict(state_dict: dict, cfg: ModelConfig) -> dict:
    """A megatron-core state dict (or its gradients) in the reference model's names."""
    if cfg.arch == "latentloop":
        layers, own = split_latent_state_dict(state_dict, cfg)
        return {**latent_reference_names(to_reference_state_dict(layers, cfg)), **own}
    return to_reference_state_dict(state_dict, cfg)


def to_reference(model):
    """A reference model carrying a (TP=1) megatron-core LoopedLM's weights, in fp32."""
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    reference = reference_class(model.cfg)(reference_config(model.cfg))
    reference.load_state_dict(reference_state_dict(state, model.cfg), strict=True)
    return reference


def invert_mapping(mapping, values: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict:
    """The tensors of ``shapes`` that ``mapping`` (a function of a state dict that only renames,
    slices, reshapes and concatenates) sends to ``values``. Raises ValueError naming the first
    tensor that is missing, unexpected or of the wrong shape.

    Each tensor the mapping slices or joins is found through an index tensor of its elements
    (int64: twice its fp32 size) and comes back as a view of one buffer of them all; one it only
    renames (an embedding, an output layer: most of a small model's weights) is taken as it is,
    found by mapping meta tensors first. So a group of tensors is mapped holding no copy of the
    values but that buffer, and index tensors only for what is sliced or joined."""
    probe = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    source_of = {id(tensor): name for name, tensor in probe.items()}
    renamed = {name: source_of[id(tensor)] for name, tensor in mapping(probe).items()
               if id(tensor) in source_of}
    ids, ranges, total = dict(probe), {}, 0  # a renamed tensor stays a meta tensor
    for name, shape in shapes.items():
        if name not in renamed.values():
            ids[name] = torch.arange(total, total + math.prod(shape)).view(shape)
            ranges[name] = total, total + math.prod(shape)
            total += math.prod(shape)
    dtype = next(iter(values.values())).dtype if values else torch.float32
    flat, found = torch.empty(total, dtype=dtype), {}
    mapped = mapping(ids)
    for name, index in mapped.items():
        if name not in values:
            raise ValueError(f"tensor {name}: missing")
        if tuple(values[name].shape) != tuple(index.shape):
            raise ValueError(f"tensor {name}: shape {tuple(values[name].shape)}, the config "
                             f"gives {tuple(index.shape)}")
        if name in renamed:
            found[renamed[name]] = values[name].to(dtype)
        else:
            flat[index.flatten()] = values[name].flatten().to(dtype)
    unexpected = sorted(set(values) - set(mapped))
    if unexpected:
        raise ValueError(f"tensor {unexpected[0]}: not part of this architecture")
    return {name: found[name] if name in found else flat[slice(*ranges[name])].view(shape)
            for name, shape in shapes.items()}

