"""Configuration of megaloop's plain-PyTorch reference models, which are also its Hugging Face models.

Imports only transformers: the file ships beside modeling_*.py in an exported directory (remote
code, ``auto_map``). Field names are megaloop's ``ModelConfig`` names with every derived default
resolved (megaloop.models.export.reference_config fills them), so the mapping is one to one;
``tie_word_embeddings``, ``max_position_embeddings`` (megaloop's seq_length: the trained context;
RoPE itself has no limit) and ``initializer_range`` are the Hugging Face names. ``moe_aux_loss_coeff``, ``moe_z_loss_coeff`` and
``joint_attention`` are megaloop's training settings (router losses, attention kernel), which these
models do not apply (their loss is the cross-entropy alone; a MoE model's first training loss
warns so): carried so that an import (megaloop.hf.from_hf) trains as the run did.

``iterations`` is K (AsymLoop), R (Full Loop) or the number of visits (LatentLoop). Set it at load
time for test-time depth, ``from_pretrained(dir, trust_remote_code=True, iterations=6)``, or per
call with ``num_iterations=`` (forward and generate); LatentLoop runs only its own. Of the fields
here, ``from_pretrained`` takes other values of ``LOAD_TIME_SETTINGS`` alone (``MegaloopConfig.
from_dict``); a loaded model's config edited afterwards is applied or refused alike, at the next
forward or save_pretrained (``MegaloopPreTrainedModel._apply_config_edits``).
"""

from __future__ import annotations

import inspect
import math

from transformers import PretrainedConfig

# The fields a loaded model may take other values of, ``from_pretrained(dir, name=value)``: those
# of megaloop's checkpoint.RESUMABLE_MODEL_FIELDS (test-time depth, the context, RoPE base, norm
# epsilon, routing width, the settings carried for an import, the initialisation of weights the
# file lacks), each applied. Every other field decides what the saved weights are: another value
# would build another model around them, so it is refused; so is ``residual_scale_init`` of
# learned scales, which the loaded scales replace.
LOAD_TIME_SETTINGS = ("iterations", "max_position_embeddings", "rotary_base", "norm_eps",
                      "moe_top_k", "moe_aux_loss_coeff", "moe_z_loss_coeff", "joint_attention",
                      "initializer_range", "residual_scale_init")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return (_integer(value) or isinstance(value, float)) and math.isfinite(value)


# What a load-time setting's value must be, as megaloop's ModelConfig.validate refuses (rather than
# a traceback from torch, NaN logits from RoPE or a norm, or no effect): (said, test).
_VALUES = {
    "iterations": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "max_position_embeddings": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "rotary_base": ("a number > 0", lambda v: _number(v) and v > 0),
    "initializer_range": ("a number > 0", lambda v: _number(v) and v > 0),
    "norm_eps": ("a number >= 0", lambda v: _number(v) and v >= 0),
    "moe_aux_loss_coeff": ("a number >= 0", lambda v: _number(v) and v >= 0),
    "moe_z_loss_coeff": ("a number >= 0", lambda v: _number(v) and v >= 0),
    "joint_attention": ("'fused' or 'masked'", lambda v: v in ("fused", "masked")),
    "moe_top_k": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
}


class MegaloopConfig(PretrainedConfig):
    model_type = "megaloop"
    attribute_map = {"num_hidden_layers": "num_layers"}

    def __init__(self, arch="asymloop", num_layers=4, hidden_size=128, ffn_hidden_size=344,
                 decoder_ffn_hidden_size=None, num_attention_heads=4, num_query_groups=None,
                 head_dim=None, vocab_size=32128, encoder_layers=2, iterations=3, block="llama",
                 qk_norm=True, injection="global_kv", local_kv=True, global_kv_norm=True,
                 rotary_base=10000.0, norm_eps=1e-5, num_experts=0, moe_layers="all", moe_top_k=2,
                 moe_ffn_hidden_size=0, moe_shared_expert_size=0, moe_aux_loss_coeff=0.01,
                 moe_z_loss_coeff=0.001, joint_attention="fused", prelude_layers=1, coda_layers=1,
                 latent_visits=(1,), latent_stride=2, latent_writeback_lag=0,
                 latent_reduction="sequence", residual_scale="learned", residual_scale_init=(),
                 untie_attention=False, untie_moe=False, max_position_embeddings=2048,
                 initializer_range=0.02, tie_word_embeddings=False, use_cache=True, **kwargs):
        self.arch = arch  # dense | fullloop | asymloop | latentloop
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.decoder_ffn_hidden_size = decoder_ffn_hidden_size or ffn_hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_query_groups = num_query_groups or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.vocab_size = vocab_size
        self.encoder_layers = encoder_layers  # AsymLoop E
        self.iterations = iterations
        self.block = block  # llama: pre-norm; olmo: norm on sublayer outputs inside the residual
        self.qk_norm = qk_norm
        self.injection = injection  # AsymLoop: global_kv | none | additive
        self.local_kv = local_kv
        self.global_kv_norm = global_kv_norm  # RMSNorm of H_E before the Global K/V projections
        self.rotary_base = rotary_base
        self.norm_eps = norm_eps
        # Mixture-of-experts FFNs (modeling_moe): 0 experts keeps the SwiGLU MLP.
        self.num_experts = num_experts
        self.moe_layers = moe_layers  # all | encoder | decoder
        self.moe_top_k = moe_top_k
        self.moe_ffn_hidden_size = moe_ffn_hidden_size
        self.moe_shared_expert_size = moe_shared_expert_size
        self.moe_aux_loss_coeff = moe_aux_loss_coeff  # training only (see the module docstring)
        self.moe_z_loss_coeff = moe_z_loss_coeff
        self.joint_attention = joint_attention  # fused | masked: megaloop's kernel, same maths
        # LatentLoop (modeling_latentloop)
        self.prelude_layers = prelude_layers
        self.coda_layers = coda_layers
        # Reduced visits, 1-based: a set (sorted). An edited config.json's other types are left
        # as written, for megaloop's import to name (megaloop.hf.from_hf).
        self.latent_visits = sorted(latent_visits) if all(
            isinstance(v, int) for v in latent_visits) else list(latent_visits)
        self.latent_stride = latent_stride
        self.latent_writeback_lag = latent_writeback_lag
        self.latent_reduction = latent_reduction  # sequence | top_k | width | expert_ffn
        self.residual_scale = residual_scale  # learned | fixed
        self.residual_scale_init = list(residual_scale_init)  # per visit; empty: 1.0
        self.untie_attention = untie_attention
        self.untie_moe = untie_moe
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.use_cache = use_cache  # forward returns a cache unless told otherwise
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """As PretrainedConfig.from_dict (which ``from_pretrained`` calls with its keyword
        arguments), refusing in one line a field of this config in ``kwargs`` that differs from
        the saved one where the saved weights fix it or replace it (``LOAD_TIME_SETTINGS``): a
        LatentLoop's ``iterations`` (each visit has its own scales, so the model runs exactly the
        visits it was trained with, as megaloop refuses other depths; a MoE Loop, whose fixed
        scales the safetensors do not hold, would run them without a word), learned scales'
        ``residual_scale_init``, any architecture field. Compared as this class stores them
        (``latent_visits`` in any order is the same model)."""
        own = [name for name in MODEL_FIELDS if name in kwargs]
        if own:
            saved = cls(**config_dict)
            asked = cls(**{**config_dict, **{name: kwargs[name] for name in own}})
            for name in own:
                value = getattr(asked, name)
                if value != getattr(saved, name):
                    problem = saved.load_time_refusal(name, value)
                    if problem:
                        raise ValueError(f"{name}={kwargs[name]!r}: {problem}")
        return super().from_dict(config_dict, **kwargs)

    def load_time_refusal(self, name: str, value) -> str | None:
        """Why a loaded model of this (saved) config cannot take ``value`` for field ``name`` (a
        depth as megaloop's ModelConfig.depth_refusal); None where it can."""
        saved = getattr(self, name)
        if name not in LOAD_TIME_SETTINGS:
            return (f"fixed by the saved weights (config.json has {saved!r}); from_pretrained may "
                    f"change only {', '.join(LOAD_TIME_SETTINGS)}")
        if name in _VALUES and not _VALUES[name][1](value):
            return f"must be {_VALUES[name][0]}"
        if name.startswith("moe_") and not self.num_experts:
            return "without effect: the model has no experts (num_experts=0)"
        if name == "moe_top_k":
            low = 2 if self.latent_reduction == "top_k" and self.latent_visits else 1
            if not low <= value <= self.num_experts:
                return (f"must be in [{low}, num_experts={self.num_experts}]"
                        + (" (its reduced visits route to moe_top_k // 2 experts)" if low == 2
                           else ""))
        if name == "iterations" and self.arch == "dense":
            return ("arch=dense has no depth to vary (it would loop its layers; arch=fullloop is "
                    "the looped stack)")
        if name == "iterations" and self.arch == "latentloop":
            return (f"arch=latentloop runs exactly its iterations={saved} visits (each has its "
                    "own scales)")
        if name == "residual_scale_init" and self.arch != "latentloop":
            return f"without effect: arch={self.arch} has no residual scales (arch=latentloop's)"
        if name == "residual_scale_init" and self.residual_scale == "learned":
            return ("without effect on a loaded model (its residual scales are learned weights, "
                    "loaded from the safetensors)")
        if name == "residual_scale_init" and not (
                isinstance(value, (list, tuple)) and len(value) in (0, self.iterations)
                and all(_number(v) for v in value)):
            return f"must be {self.iterations} numbers, one per visit (or [] for 1.0 each)"
        return None

    @property
    def num_encoder_layers(self) -> int:
        """Layers before the loop (AsymLoop only; LatentLoop's prelude is ``prelude_layers``)."""
        return self.encoder_layers if self.arch == "asymloop" else 0


# The names of MegaloopConfig's model settings: its own fields but ``use_cache`` (what forward
# does by default, no setting of the model). Listed once: a model compares them at every forward.
MODEL_FIELDS = tuple(name for name in inspect.signature(MegaloopConfig.__init__).parameters
                     if name not in ("self", "kwargs", "use_cache"))


class LatentLoopConfig(MegaloopConfig):
    """MegaloopConfig of a LatentLoop model: its own class (and model_type), so that transformers'
    auto classes, which map one config class to one model class, tell the two models apart."""

    model_type = "megaloop_latentloop"

    def __init__(self, arch="latentloop", **kwargs):
        super().__init__(arch=arch, **kwargs)
