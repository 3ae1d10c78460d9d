"""Model presets: the LLaMA-family sizes of He et al. (seq 1024, vocab 32128), OLMo-style and 7B.

A preset fixes the *size*; the architecture (``arch``, ``iterations``, ablation switches) is chosen on
top, e.g. ``preset("135M", arch="fullloop", iterations=2)``. Parameter counts are printed by
``tools/flops.py`` so that differences such as the 60M FFN (1512 here, 2048 in the paper's
Appendix E) stay visible.
"""

from __future__ import annotations

import dataclasses
import difflib

from megaloop.config import ConfigError, ModelConfig

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

def preset(name: str, **overrides) -> ModelConfig:
    """A resolved copy of preset ``name`` with field overrides, e.g. ``arch="fullloop"``; the
    iteration count defaults per architecture (config.DEFAULT_ITERATIONS)."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            raise ConfigError(f"unknown field model.{key}"
                              + (f" (did you mean {close[0]}?)" if close else ""))
    cfg = dataclasses.replace(PRESETS[name], **overrides)
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
