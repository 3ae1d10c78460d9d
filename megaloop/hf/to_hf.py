"""megaloop dist checkpoint -> Hugging Face directory.

The directory holds model.safetensors (only safetensors are written), config.json,
generation_config.json and, when the run has one, its tokenizer (megaloop.hf.tokenizer). A Dense
model whose block a transformers class has loads as that class (megaloop.hf.native); every other
model loads as megaloop's reference model, whose files (megaloop/reference/*.py, importing only
torch and transformers) are copied beside the weights and registered in config.json's ``auto_map``:

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)

Before the directory is renamed into place, it is loaded back through that very call and its
logits on a probe input must equal the checkpoint's (megaloop.hf.common).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megaloop.config import ModelConfig
from megaloop.hf.checkpoint import load_checkpoint_model, weights
from megaloop.hf.common import ConversionError, compare_logits, probe_ids, staged_output
from megaloop.hf.native import FAMILIES, native_config, native_family, to_native_state_dict

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"
# Shipped as remote code: the configuration and every modeling file (they import one another).
REMOTE_CODE_FILES = ("configuration_megaloop.py", "modeling_asymloop.py", "modeling_moe.py",
                     "modeling_latentloop.py")


def probe_length(cfg: ModelConfig) -> int:
    """An odd length (a LatentLoop tail of incomplete latents is part of the probe) within the
    trained context."""
    return max(1, min(cfg.seq_length, 64) - 1)


def hf_model(cfg: ModelConfig, reference: dict[str, torch.Tensor], special_tokens: dict):
    """The Hugging Face model carrying ``reference`` (the reference model's tensors): a native
    class where ``native_family`` finds one, else the reference model with its ``auto_map``."""
    import transformers

    from megaloop.models.export import reference_class, reference_config

    family, _ = native_family(cfg)
    if family is not None:
        model = getattr(transformers, FAMILIES[family])(native_config(cfg, family, special_tokens))
        model.load_state_dict(to_native_state_dict(reference, family), strict=True)
        return model
    config = reference_config(cfg)
    config.update(special_tokens)
    model_class = reference_class(cfg)
    config.auto_map = {"AutoConfig": f"configuration_megaloop.{type(config).__name__}",
                       "AutoModelForCausalLM": f"{model_class.__module__.rsplit('.', 1)[1]}."
                                               f"{model_class.__name__}"}
    model = model_class(config)
    model.load_state_dict(reference, strict=True)
    return model


def export_checkpoint(checkpoint: str | Path, out: str | Path, *,
                      requested: ModelConfig | None = None, tokenizer: str | None = None,
                      with_tokenizer: bool = True) -> dict:
    """Converts ``checkpoint`` (any parallel layout) into the Hugging Face directory ``out``.

    ``requested``: refuse a checkpoint of another architecture. ``tokenizer``: a tokenizer file in
    place of the run's ``data.tokenizer_model``; ``with_tokenizer=False`` writes none. Returns a
    report (class, remote code or not and why, probe difference, tokenizer)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from megaloop.models.export import reference_state_dict

    with staged_output(out) as staging:  # first: an unusable output directory fails at once
        model, run, path = load_checkpoint_model(checkpoint, requested)
        cfg = run.model
        tokenizer = (tokenizer or run.data.tokenizer_model) if with_tokenizer else None
        if tokenizer is not None and not Path(tokenizer).exists():
            source = "--tokenizer" if tokenizer != run.data.tokenizer_model else \
                "the run's data.tokenizer_model"
            raise ConversionError(f"{tokenizer}: tokenizer file not found ({source}); pass "
                                  "--tokenizer PATH, or --no-tokenizer")
        ids = probe_ids(cfg.vocab_size, probe_length(cfg))
        with torch.no_grad():
            expected = model(ids.to(next(model.parameters()).device)).float().cpu()
        reference = reference_state_dict(weights(model), cfg)
        del model
        family, why_not_native = native_family(cfg)
        special_tokens = {"bos_token_id": None, "eos_token_id": run.data.eod_id}
        if tokenizer is not None:
            from megaloop.hf.tokenizer import write_tokenizer

            special_tokens = write_tokenizer(tokenizer, staging, cfg.vocab_size)
        converted = hf_model(cfg, reference, special_tokens)
        converted.save_pretrained(staging)
        del converted
        GenerationConfig(**special_tokens, pad_token_id=special_tokens["eos_token_id"],
                         do_sample=False).save_pretrained(staging)
        if family is None:
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(REFERENCE_DIR / name, staging / name)
        loaded = AutoModelForCausalLM.from_pretrained(staging, trust_remote_code=family is None,
                                                      dtype=torch.float32)
        with torch.no_grad():
            logits = loaded(ids, use_cache=False).logits
        difference = compare_logits(expected, logits, f"{out} (from {path})")
        class_name = type(loaded).__name__
    return {"checkpoint": str(path), "output": str(out), "class": class_name,
            "remote_code": family is None, "why_remote_code": why_not_native or None,
            "probe_max_abs_difference": difference, "tokenizer": str(tokenizer) if tokenizer
            else None}
