"""Native transformers classes that compute exactly what a megaloop Dense model computes.

A Dense model (one pass over its layers) needs no remote code when a transformers class has its
block:
- ``llama``: pre-norm, no QK-norm -> LlamaForCausalLM;
- ``qwen3``: pre-norm, per-head QK-norm before RoPE -> Qwen3ForCausalLM;
- ``olmo2``: the OLMo block (norms on the sublayer outputs) -> Olmo2ForCausalLM, but only where the
  QK-norms agree: OLMo 2 normalises q (and k) over all heads at once, one RMSNorm of width
  heads x head_dim, while megaloop's OLMo block normalises each head, as Qwen3 does. The two agree
  for one attention head and one query group only; other OLMo-block models export as remote code;
- ``mixtral`` / ``qwen3_moe``: MoE FFNs in every layer, no / per-head QK-norm. Their routers take
  the softmax over all experts, keep the top k and renormalise (Qwen3-MoE with norm_topk_prob),
  which equals megatron-core's softmax over the top-k logits; the top-k sets agree since softmax is
  monotonic. Their router runs in the model's dtype, megaloop's in fp32: identical in fp32, a
  rounding apart in bf16. A shared expert (ungated in megaloop, gated in Qwen2-MoE) has no native
  class: such a model exports as remote code.
Looped models (Full Loop, AsymLoop, LatentLoop) have no native class. ``native_family`` says which
class fits or why none does.
"""

from __future__ import annotations

import logging
import re

import torch

from megaloop.config import ModelConfig
from megaloop.hf.common import ConversionError

log = logging.getLogger("megaloop.hf")

FAMILIES = {  # family (config.json model_type) -> transformers causal-LM class
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_OLMO2_NORMS = ("Olmo2 normalises q and k over all heads at once (width heads x head_dim), "
                "megaloop's OLMo block each head; they agree only with one head and one query group")


def native_family(cfg: ModelConfig) -> tuple[str | None, str]:
    """(family, "") of the native class computing ``cfg``'s model, or (None, why none does)."""
    if cfg.arch != "dense":
        return None, f"arch={cfg.arch} loops its layers, which no transformers class does"
    if cfg.block == "olmo":
        if not cfg.qk_norm:
            return None, "Olmo2 always normalises q and k; this OLMo-block model has qk_norm=false"
        if cfg.num_attention_heads != 1 or cfg.num_query_groups != 1:
            return None, _OLMO2_NORMS
        return "olmo2", ""
    if cfg.uses_moe:
        if cfg.moe_shared_expert_size:
            return None, "no transformers MoE class has an ungated shared expert"
        return ("qwen3_moe" if cfg.qk_norm else "mixtral"), ""
    return ("qwen3" if cfg.qk_norm else "llama"), ""


def native_config(cfg: ModelConfig, family: str, special_tokens: dict):
    """The transformers config of ``family`` for ``cfg`` (resolved); ``special_tokens``: the bos
    and eos token ids (None where unknown). No pad token: the classes' defaults (Llama's bos 1,
    OLMo 2's pad 1 and eos 50279) are not megaloop's."""
    import transformers

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels,
                  max_position_embeddings=cfg.seq_length, initializer_range=cfg.init_std,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
                  attention_bias=False, hidden_act="silu", pad_token_id=None, **special_tokens)
    specific = {
        "llama": dict(intermediate_size=cfg.ffn_hidden_size, mlp_bias=False),
        "qwen3": dict(intermediate_size=cfg.ffn_hidden_size, use_sliding_window=False),
        "olmo2": dict(intermediate_size=cfg.ffn_hidden_size),
        "mixtral": dict(intermediate_size=cfg.moe_ffn_hidden_size, sliding_window=None,
                        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_top_k),
        "qwen3_moe": dict(intermediate_size=cfg.ffn_hidden_size, use_sliding_window=False,
                          moe_intermediate_size=cfg.moe_ffn_hidden_size,
                          num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_top_k,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    }[family]
    if cfg.uses_moe:
        specific["router_aux_loss_coef"] = hf_router_aux_loss_coef(cfg)
    config_class = getattr(transformers, FAMILIES[family].replace("ForCausalLM", "Config"))
    return config_class(**common, **specific)


# The load-balancing loss of Mixtral and Qwen3-MoE (transformers' load_balancing_loss_func) is one
# Switch loss over the gates of all L layers together, E sum_i f_i P_i with f_i, P_i the shares of
# expert i among the L T k top-k choices (so sum_i f_i = k) and of the L T router probabilities,
# times router_aux_loss_coef (a_hf); megatron-core's is one per MoE layer, E / (k T^2) sum_i n_i^l
# sum_t p_ti^l (n_i^l: layer l's tokens for expert i), each times moe_aux_loss_coeff (a_ml) and
# summed. On layer l's probabilities the gradients are a_hf E / (L T^2) mean_m(n_i^m) and a_ml E /
# (k T^2) n_i^l: with a_ml = a_hf k / L they are equal, as are the two losses, when every layer
# routes alike (balanced: a_hf k both). Otherwise HF pulls each layer toward the balance of all
# layers together, which no per-layer coefficient reproduces: a_hf k / L is the closest.
def hf_router_aux_loss_coef(cfg: ModelConfig) -> float:
    """router_aux_loss_coef of a native MoE class for ``cfg`` (dense, MoE in every layer)."""
    return cfg.moe_aux_loss_coeff * cfg.num_layers / cfg.moe_top_k


def megaloop_aux_loss_coeff(router_aux_loss_coef: float, layers: int, top_k: int) -> float:
    return router_aux_loss_coef * top_k / layers


def note_router_losses(cfg: ModelConfig) -> None:
    """Warns (a line each) that the two load-balancing losses agree only for alike routing, and
    that the native classes have no router z-loss (nothing for a dense model)."""
    if not cfg.uses_moe:
        return
    if cfg.moe_z_loss_coeff:
        log.warning("model.moe_z_loss_coeff=%g: Mixtral and Qwen3-MoE have no router z-loss; "
                    "training the export in transformers leaves it out", cfg.moe_z_loss_coeff)
    if cfg.num_layers > 1 and cfg.moe_aux_loss_coeff:
        log.warning("router_aux_loss_coef=%g (Hugging Face: one load-balancing loss over all %d "
                    "layers' gates) <-> model.moe_aux_loss_coeff=%g (megaloop: one per layer, "
                    "summed): equal losses and gradients when the layers route alike, the "
                    "closest otherwise; transformers applies it only with "
                    "output_router_logits=True (off in the export, as in Mixtral's own configs: "
                    "set it to fine-tune there)", hf_router_aux_loss_coef(cfg), cfg.num_layers,
                    cfg.moe_aux_loss_coeff)


def _require(ok: bool, what: str, value, allowed: str) -> None:
    if not ok:
        raise ConversionError(f"config.json {what}={value!r}: must be {allowed} (megaloop has no "
                              "such variant)")


def model_config_from_native(hf) -> ModelConfig:
    """The megaloop ModelConfig of a native transformers config; refuses, naming the field, what
    megaloop does not compute (biases, other activations, RoPE scaling, sliding windows, ...)."""
    family = hf.model_type
    rope = getattr(hf, "rope_parameters", None) or {}
    _require(getattr(hf, "hidden_act", "silu") == "silu", "hidden_act", hf.hidden_act, "'silu'")
    _require(not getattr(hf, "attention_bias", False), "attention_bias", True, "false")
    _require(not getattr(hf, "mlp_bias", False), "mlp_bias", True, "false")
    _require(rope.get("rope_type", "default") == "default", "rope_parameters.rope_type",
             rope.get("rope_type"), "'default' (no RoPE scaling)")
    _require(not getattr(hf, "use_sliding_window", False) and (
        family in ("qwen3", "qwen3_moe") or getattr(hf, "sliding_window", None) is None),
        "sliding_window", getattr(hf, "sliding_window", None), "off")
    # Training-only noise: the probe's eval-mode logits cannot tell it is missing.
    for name in ("attention_dropout", "router_jitter_noise"):
        value = getattr(hf, name, 0.0) or 0.0
        _require(value == 0, name, value, "0")
    heads, groups = hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    moe = {}
    if family == "olmo2":
        _require(heads == 1 and groups == 1, "num_attention_heads", heads, f"1 ({_OLMO2_NORMS})")
    if family in ("mixtral", "qwen3_moe"):
        # Neither class has a router z-loss.
        moe = dict(moe_top_k=hf.num_experts_per_tok, moe_z_loss_coeff=0.0,
                   moe_aux_loss_coeff=megaloop_aux_loss_coeff(
                       hf.router_aux_loss_coef, hf.num_hidden_layers, hf.num_experts_per_tok))
    if family == "mixtral":
        moe.update(num_experts=hf.num_local_experts, moe_ffn_hidden_size=hf.intermediate_size)
    if family == "qwen3_moe":
        _require(hf.norm_topk_prob, "norm_topk_prob", hf.norm_topk_prob, "true")
        _require(hf.decoder_sparse_step == 1 and not hf.mlp_only_layers, "mlp_only_layers",
                 hf.mlp_only_layers, "empty with decoder_sparse_step=1 (MoE in every layer)")
        moe.update(num_experts=hf.num_experts, moe_ffn_hidden_size=hf.moe_intermediate_size)
    ffn = hf.intermediate_size if family != "mixtral" else hf.intermediate_size * hf.num_experts_per_tok
    return ModelConfig(
        arch="dense", iterations=1, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        ffn_hidden_size=ffn, num_attention_heads=heads, num_query_groups=groups,
        head_dim=None if head_dim == hf.hidden_size // heads else head_dim,
        vocab_size=hf.vocab_size, seq_length=hf.max_position_embeddings,
        block="olmo" if family == "olmo2" else "llama",
        qk_norm=family in ("qwen3", "qwen3_moe", "olmo2"),
        rotary_base=float(rope.get("rope_theta", 10000.0)), norm_eps=hf.rms_norm_eps,
        init_std=hf.initializer_range, tie_embeddings=bool(hf.tie_word_embeddings), **moe,
    ).resolve()


_TOP = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
# The OLMo block's norms sit after the sublayers (megaloop keeps the pre-norm names for them).
_OLMO2_LAYER = {**_LAYER, "attn_norm.weight": "post_attention_layernorm.weight",
                "mlp_norm.weight": "post_feedforward_layernorm.weight"}
_DECODER = re.compile(r"^decoder\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def to_native_state_dict(reference: dict, family: str) -> dict:
    """Reference-model tensors (a Dense model's) in the native class's names; experts stacked as
    transformers keeps them: gate_up_proj [E, 2 x I, H] ([gate; up] per expert), down_proj
    [E, H, I]."""
    layer_names = _OLMO2_LAYER if family == "olmo2" else _LAYER
    out, experts = {}, {}
    for name, tensor in reference.items():
        if name in _TOP:
            out[_TOP[name]] = tensor
            continue
        index, rest = _DECODER.match(name).groups()
        prefix = f"model.layers.{index}."
        expert = _EXPERT.match(rest)
        if expert:
            experts.setdefault(prefix, {})[(int(expert.group(1)), expert.group(2))] = tensor
        else:
            out[prefix + layer_names[rest]] = tensor
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        out[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(count)])
        out[prefix + "mlp.experts.down_proj"] = torch.stack([parts[(e, "down")]
                                                             for e in range(count)])
    return out
