"""Weight mapping of MoE layers and LatentLoop from the canonical megatron-core model onto the
plain-PyTorch reference (megaloop.reference.modeling_moe / modeling_latentloop), used by
``megaloop.models.export`` for the parts those models add. Works on a full (TP=1, EP=1) state dict.
"""

from __future__ import annotations

import re

import torch

from megaloop.config import ModelConfig

# Local experts (SequentialMLP) and Transformer Engine's grouped experts (weight<e> per expert).
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc([12])\.weight"
                     r"|linear_fc([12])\.weight(\d+))$")
_VISIT = re.compile(r"^visits\.visit(\d+)\.(.+)$")
_LATENT_BLOCKS = {"encoder": "prelude", "decoder": "middle"}


def moe_reference_fields(cfg: ModelConfig) -> dict:
    """The MoE fields of the reference config, the router loss coefficients among them (read by
    no reference model: an import trains with them)."""
    if not cfg.uses_moe:
        return {}
    return dict(num_experts=cfg.num_experts, moe_layers=cfg.moe_layers, moe_top_k=cfg.moe_top_k,
                moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
                moe_shared_expert_size=cfg.moe_shared_expert_size,
                moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_z_loss_coeff=cfg.moe_z_loss_coeff)


def _swiglu(prefix: str, suffix: str, tensor: torch.Tensor) -> dict:
    """A SwiGLU linear: fc1 is [gate; up] (the activation applies to the first half)."""
    if suffix == "1":
        gate, up = tensor.chunk(2, dim=0)
        return {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up}
    return {f"{prefix}.down_proj.weight": tensor}


def moe_reference_weights(suffix: str, tensor: torch.Tensor) -> dict | None:
    """Reference weights (names relative to the layer) of one MoE layer parameter, or None if
    ``suffix`` is not one."""
    if suffix == "mlp.router.weight":
        return {"mlp.router.weight": tensor}
    shared = re.match(r"^mlp\.shared_experts\.linear_fc([12])\.weight$", suffix)
    if shared:
        return _swiglu("mlp.shared_expert", shared.group(1), tensor)
    expert = _EXPERT.match(suffix)
    if expert is None:
        return None
    index, fc = (expert.group(1), expert.group(2)) if expert.group(1) is not None \
        else (expert.group(4), expert.group(3))
    return _swiglu(f"mlp.experts.{index}", fc, tensor)


def latent_reference_fields(cfg: ModelConfig) -> dict:
    """The LatentLoop fields of the reference config (empty for other architectures)."""
    if cfg.arch != "latentloop":
        return {}
    return dict(prelude_layers=cfg.num_prelude_layers, coda_layers=cfg.num_coda_layers,
                latent_visits=list(cfg.latent_visits), latent_stride=cfg.latent_stride,
                latent_writeback_lag=cfg.latent_writeback_lag,
                latent_reduction=cfg.latent_reduction, residual_scale=cfg.residual_scale,
                residual_scale_init=list(cfg.residual_scale_init),
                untie_attention=cfg.untie_attention, untie_moe=cfg.untie_moe)


def split_latent_state_dict(state_dict: dict, cfg: ModelConfig) -> tuple[dict, dict]:
    """Separates LatentLoop's per-visit parameters (already in reference names) from the layer
    weights, whose per-visit blocks are renamed ``visit<v>.layers.<i>.*`` for the layer mapping."""
    layers, own = {}, {}
    scales = {}
    for name, tensor in state_dict.items():
        match = _VISIT.match(name)
        if match is None:
            layers[name] = tensor
            continue
        visit, rest = match.groups()
        if rest == "residual_scale":
            scales[int(visit)] = tensor
        elif rest == "compression.channel_scales":
            own[f"writeback.{visit}"] = tensor.view(cfg.latent_stride, cfg.hidden_size)
        elif rest in ("projection.down_weight", "projection.up_weight"):
            own[f"projection.{visit}.{rest.split('.')[1].split('_')[0]}.weight"] = tensor
        elif rest.startswith("block."):
            layers[f"visit{visit}.{rest[len('block.'):]}"] = tensor
        else:
            raise KeyError(f"unmapped megatron-core parameter {name}")
    if scales:
        own["residual_scales"] = torch.cat([scales[v] for v in sorted(scales)])
    return layers, own


def latent_reference_names(mapped: dict) -> dict:
    """Block names of the layer mapping -> the reference LatentLoop's: encoder -> prelude,
    decoder -> middle, visit<v> -> untied_attention.<v> / untied_ffn.<v>."""
    out = {}
    for name, tensor in mapped.items():
        block, rest = name.split(".", 1)
        if block.startswith("visit"):
            part = "untied_attention" if rest.split(".", 1)[1].startswith("attn") else "untied_ffn"
            name = f"{part}.{block[len('visit'):]}.{rest}"
        else:
            name = f"{_LATENT_BLOCKS.get(block, block)}.{rest}"
        out[name] = tensor
    return out
