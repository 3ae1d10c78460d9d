"""Model presets: the LLaMA-family sizes of He et al. (seq 1024, vocab 32128), OLMo-style and 7B,
and the LatentLoop family (MoE base / MoE Loop / LatentLoop at 1.3B, 3B, 7B, matched budgets).

A size preset fixes the *size*; the architecture (``arch``, ``iterations``, ablation switches) is
chosen on top, e.g. ``preset("135M", arch="fullloop", iterations=2)``. The LatentLoop family's
presets (``ARCH_BOUND``) fix the architecture too, since their widths are matched to it.
Parameter counts are printed by ``tools/flops.py`` so that differences such as the 60M FFN (1512
here, 2048 in the paper's Appendix E) stay visible.
"""

from __future__ import annotations

import dataclasses

from megaloop.config import ConfigError, ModelConfig, from_dict

PAPER_VOCAB = 32128  # T5 SentencePiece, 32000 padded to a multiple of 128
PAPER_SEQ = 1024

PRESETS: dict[str, ModelConfig] = {
    # CPU-sized model for the quickstart, tests and laptop debugging.
    "tiny": ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=344, num_attention_heads=4,
                        vocab_size=4096, seq_length=128),
    "60M": ModelConfig(num_layers=6, hidden_size=768, ffn_hidden_size=1512, num_attention_heads=12),
    "135M": ModelConfig(num_layers=12, hidden_size=768, ffn_hidden_size=2048, num_attention_heads=12),
    "350M": ModelConfig(num_layers=24, hidden_size=1024, ffn_hidden_size=2736, num_attention_heads=16),
    "1B": ModelConfig(num_layers=24, hidden_size=2048, ffn_hidden_size=5461, num_attention_heads=32),
    # LLaMA-2-7B dimensions.
    "7B": ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                      vocab_size=32000, seq_length=4096),
    # OLMo-2 style backbone of the paper's Appendix G: a block variant as well as a size.
    "olmo": ModelConfig(num_layers=8, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8,
                        block="olmo", vocab_size=49152),
}
for _name in ("60M", "135M", "350M", "1B"):
    PRESETS[_name] = dataclasses.replace(PRESETS[_name], vocab_size=PAPER_VOCAB, seq_length=PAPER_SEQ)
PRESETS["olmo"] = dataclasses.replace(PRESETS["olmo"], seq_length=PAPER_SEQ)

# LatentLoop family (seed paper 001): fine-grained MoE (top-8) at the paper's tiers, seq 2048. The
# paper's text gives no layer counts or widths beyond the 3B LatentLoop's d=1296, d_h=140, E=75, so
# the MoE Loop baselines (prelude 2 | middle x 2 visits | coda 2) are megaloop's sizing for ~1.3B, 3B
# and 7B total parameters; tools/match_budget.py derives the LatentLoop and MoE base widths that
# match each within 1% on parameters, KV cache and FLOPs, written below (tests hold them to it).
LATENTLOOP_SEQ = 2048


def _moe_loop(layers: int, middle: int, hidden: int, heads: int, experts: int,
              expert_size: int, **fields) -> ModelConfig:
    edge = (layers - middle) // 2
    fields = {**dict(vocab_size=PAPER_VOCAB, seq_length=LATENTLOOP_SEQ, moe_top_k=8), **fields}
    return ModelConfig(arch="latentloop", iterations=2, num_layers=layers, prelude_layers=edge,
                       coda_layers=edge, latent_visits=[], residual_scale="fixed",
                       hidden_size=hidden, num_attention_heads=heads,
                       ffn_hidden_size=expert_size * fields["moe_top_k"], num_experts=experts,
                       moe_ffn_hidden_size=expert_size, **fields)


LATENTLOOP_TIERS: dict[str, ModelConfig] = {
    "1.3B": _moe_loop(10, 6, 1024, 8, 76, 512),
    "3B": _moe_loop(12, 8, 1280, 10, 80, 768),
    "7B": _moe_loop(14, 10, 2048, 16, 76, 1024),
}
# (hidden size, head dim, experts) from tools/match_budget.py, per tier.
_MATCHED = {
    "latentloop": {"1.3B": (1200, 158, 63), "3B": (1536, 160, 65), "7B": (2448, 162, 62)},
    "moe-base": {"1.3B": (1024, 128, 47), "3B": (1280, 128, 47), "7B": (2048, 128, 43)},
}
for _tier, _loop in LATENTLOOP_TIERS.items():
    PRESETS[f"moe-loop-{_tier}"] = _loop
    _d, _dh, _e = _MATCHED["latentloop"][_tier]
    PRESETS[f"latentloop-{_tier}"] = dataclasses.replace(
        _loop, latent_visits=[1], residual_scale="learned", hidden_size=_d, head_dim=_dh,
        num_experts=_e)
    _d, _dh, _e = _MATCHED["moe-base"][_tier]
    PRESETS[f"moe-base-{_tier}"] = ModelConfig(
        arch="dense", iterations=1, num_layers=_loop.num_layers + _loop.num_decoder_layers,
        hidden_size=_d, head_dim=_dh, num_experts=_e, num_attention_heads=_loop.num_attention_heads,
        ffn_hidden_size=_loop.ffn_hidden_size, moe_top_k=_loop.moe_top_k,
        moe_ffn_hidden_size=_loop.moe_ffn_hidden_size, vocab_size=_loop.vocab_size,
        seq_length=_loop.seq_length)
# CPU-sized LatentLoop for tests, debugging and benchmarks.
PRESETS["latentloop-tiny"] = _moe_loop(4, 2, 128, 4, 8, 64, moe_top_k=2, vocab_size=4096,
                                       seq_length=128)
PRESETS["latentloop-tiny"] = dataclasses.replace(PRESETS["latentloop-tiny"], latent_visits=[1],
                                                 residual_scale="learned")
# Presets whose architecture is part of the preset (the others fix only a size).
ARCH_BOUND = tuple(name for name in PRESETS if name.split("-")[0] in ("moe", "latentloop"))


def check_arch(name: str, arch: str, field: str = "model.arch") -> None:
    """A one-line ConfigError when ``arch`` is not that of an architecture-bound preset ``name``:
    refused there, the other model would fail on a field the preset sets for its own
    ("model.prelude_layers=1: must be left at its default None unless arch=latentloop")."""
    own = PRESETS[name].arch
    if name in ARCH_BOUND and arch != own:
        sizes = ", ".join(n for n in PRESETS if n not in ARCH_BOUND)
        raise ConfigError(f"{field}={arch!r}: preset {name!r} is an arch={own!r} model; the size "
                          f"presets {sizes} take any architecture")


def preset(name: str, **overrides) -> ModelConfig:
    """A resolved copy of preset ``name`` with field overrides, e.g. ``arch="fullloop"``; the
    iteration count defaults per architecture (config.DEFAULT_ITERATIONS). An unknown field or a
    value of the wrong type or choice (``arch="asym"``) is a one-line ConfigError naming it, as in
    a YAML config: the overrides are read as one would be (``dataclasses.replace`` checks
    nothing, and an unknown arch surfaced as a bare KeyError of the iteration defaults)."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    if "arch" in overrides:
        check_arch(name, overrides["arch"], "arch")
    cfg = from_dict(ModelConfig, {**dataclasses.asdict(PRESETS[name]), **overrides}, "model")
    cfg.validate()
    return cfg


def no_global_kv_wide(cfg: ModelConfig) -> ModelConfig:
    """Ablation: drop Global KV and widen the decoder FFN to restore the parameter count.

    Global KV adds 2 * hidden * kv_dim weights (+ one norm) per decoder layer; a SwiGLU FFN has
    3 * hidden * ffn, so the decoder FFN grows by round(2 * kv_dim / 3).
    """
    cfg = dataclasses.replace(cfg).resolve()
    kv_dim = cfg.num_query_groups * cfg.kv_channels
    return dataclasses.replace(cfg, injection="none",
                               decoder_ffn_hidden_size=cfg.ffn_hidden_size + round(2 * kv_dim / 3))
