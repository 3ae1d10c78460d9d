"""Whether this machine can train a run in FP8 with a given Transformer Engine recipe.

FP8 needs Transformer Engine and a GPU whose tensor cores take FP8 (Hopper, Ada, Blackwell);
MXFP8 block scaling needs Blackwell, current scaling Transformer Engine >= 2.2; and every FP8 GEMM
needs sizes its kernels take (``check_fp8_shapes``). Each missing piece is one ConfigError line
naming the setting, before any process group or model exists.
"""

from __future__ import annotations

import dataclasses

from megaloop.config import ConfigError

# megaloop's recipe name -> the Transformer Engine recipe class it needs.
_RECIPE_CLASSES = {"current": "Float8CurrentScaling", "delayed": "DelayedScaling",
                   "mxfp8": "MXFP8BlockScaling"}


def _state_manager():
    try:  # Transformer Engine >= 2.8 moved it; the old module still re-exports it, with a warning
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def check_fp8_support(recipe: str) -> None:
    """Raises ConfigError unless Transformer Engine can run ``recipe`` on this machine's GPU."""
    from megaloop.models.specs import transformer_engine_available

    setting = f"train.fp8_recipe={recipe!r}"
    if not transformer_engine_available():
        raise ConfigError(f"train.precision='fp8' ({setting}): needs Transformer Engine on a CUDA "
                          "GPU (use bf16 or fp32 here)")
    from transformer_engine.common import recipe as te_recipe

    if not hasattr(te_recipe, _RECIPE_CLASSES[recipe]):
        raise ConfigError(f"{setting}: this Transformer Engine has no {_RECIPE_CLASSES[recipe]} "
                          "(current scaling needs >= 2.2); use fp8_recipe=delayed")
    manager = _state_manager()
    available, reason = (manager.is_mxfp8_available() if recipe == "mxfp8"
                         else manager.is_fp8_available())
    if not available:
        raise ConfigError(f"{setting}: not supported on this GPU ({reason})")


# Transformer Engine's FP8 GEMMs (utils.assert_dim_for_fp8_exec, asserted in every FP8 linear's
# forward): each operand's rows (tokens; a weight's output features) a multiple of 8, the inner
# dimension they reduce over of 16. MXFP8's 32-element scaling blocks need 32 for both.
_GEMM_MULTIPLES = {"current": (8, 16), "delayed": (8, 16), "mxfp8": (32, 32)}


def _gemm_dims(cfg) -> list[tuple[str, int, str]]:
    """(what, size on one rank, "rows" or "inner") of every GEMM that runs in FP8: those of
    Transformer Engine's linears inside the layers' forward, where megatron-core enters FP8, and
    AsymLoop's Global K/V projections, which LoopedLM.global_kv runs in the decoder's FP8
    context (not the output layer, the routers, nor LatentLoop's width projections). The Global
    K/V projection needs no entry of its own: its rows, 2 x num_query_groups x head dim, are the
    query/key/value rows less the query's, both multiples of what the rows need. Grouped-GEMM
    experts pad their tokens themselves."""
    model, par, train = dataclasses.replace(cfg.model).resolve(), cfg.parallel, cfg.train
    tp = par.tensor
    split = " / parallel.tensor" if tp > 1 else ""
    tokens = train.micro_batch_size * model.seq_length // (tp if par.sequence_parallel else 1)
    dims = [(f"train.micro_batch_size x model.seq_length"
             f"{split if par.sequence_parallel else ''}", tokens, "rows")]
    blocks = [("model", model)]
    if model.arch == "latentloop":
        for visit in range(1, model.iterations + 1):
            block = model.visit_block_config(visit)
            if block != model:
                blocks.append((f"visit {visit}'s (model.latent_reduction="
                               f"{model.latent_reduction!r})", block))
            if model.visit_reduction(visit) == "sequence":
                dims.append(("train.micro_batch_size x (model.seq_length // model.latent_stride)",
                             train.micro_batch_size * (model.seq_length // model.latent_stride),
                             "rows"))
    for label, m in blocks:
        heads, groups, kv = m.num_attention_heads, m.num_query_groups, m.kv_channels
        dims += [(f"{label} hidden_size", m.hidden_size, "inner"),
                 (f"{label} num_attention_heads x head dim{split}", heads * kv // tp, "inner"),
                 (f"{label} (num_attention_heads + 2 x num_query_groups) x head dim{split}",
                  (heads + 2 * groups) * kv // tp, "rows")]
        if not m.uses_moe or (m.arch == "asymloop" and m.moe_layers != "all"):
            dims += [(f"{label} {name}{split}", getattr(m, name) // tp, "inner")
                     for name in ("ffn_hidden_size", "decoder_ffn_hidden_size")]
        if m.uses_moe:
            dims.append((f"{label} moe_ffn_hidden_size{split}", m.moe_ffn_hidden_size // tp,
                         "inner"))
            if m.moe_shared_expert_size:
                dims.append((f"{label} moe_shared_expert_size{split}",
                             m.moe_shared_expert_size // tp, "inner"))
    return dims


def check_fp8_shapes(cfg) -> None:
    """Raises ConfigError, naming the setting, when a GEMM of run config ``cfg`` (precision fp8)
    has a shape Transformer Engine's FP8 GEMMs refuse: they assert it in the first forward pass,
    after the model is built (the 60M and 1B presets' FFN widths, 1512 and 5461, are such).
    Nothing to check for another precision."""
    if cfg.train.precision != "fp8":
        return
    recipe = cfg.train.resolved_fp8_recipe
    multiples = dict(zip(("rows", "inner"), _GEMM_MULTIPLES[recipe]))
    for what, size, role in _gemm_dims(cfg):
        if size % multiples[role]:
            raise ConfigError(
                f"train.precision='fp8' (fp8_recipe={recipe!r}): {what} = {size} is a GEMM "
                f"{'row count' if role == 'rows' else 'inner dimension'}, which Transformer "
                f"Engine's FP8 GEMMs need to be a multiple of {multiples[role]}; use "
                "train.precision=bf16, or sizes that are")
