"""megaloop dist checkpoint -> Hugging Face directory.

The directory holds model.safetensors (only safetensors are written), config.json,
generation_config.json and, when the run has one, its tokenizer (megaloop.hf.tokenizer). A Dense
model whose block a transformers class has loads as that class (megaloop.hf.native); every other
model loads as megaloop's reference model, whose files (megaloop/reference/*.py, importing only
torch and transformers) are copied beside the weights and registered in config.json's ``auto_map``:

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)

Before the directory is renamed into place, it is loaded back through that very call and its
logits on a probe input must equal the checkpoint's (megaloop.hf.common), in fp32 and with the
weights rounded as the file holds them (``--dtype bfloat16`` or ``float16``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megaloop.config import ModelConfig
from megaloop.hf.checkpoint import load_checkpoint_model, stored_dtype, weights
from megaloop.hf.common import (ConversionError, ProbeMismatch, compare_logits, export_dtype,
                                probe_ids, probe_logits, staged_output)
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
                      with_tokenizer: bool = True, dtype: str | None = None) -> dict:
    """Converts ``checkpoint`` (any parallel layout) into the Hugging Face directory ``out``.

    ``requested``: refuse a checkpoint of another architecture. ``tokenizer``: a tokenizer file in
    place of the run's ``data.tokenizer_model``; ``with_tokenizer=False`` writes none. ``dtype``
    (a DTYPES name): what the safetensors hold and config.json's ``dtype`` says, the dtype
    ``from_pretrained`` loads in; by default the one the checkpoint holds its weights in, which
    loses nothing. Returns a report (class, remote code or not and why, dtype, file size, probe
    differences, tokenizer)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from megaloop.models.export import reference_state_dict

    chosen = None if dtype is None else export_dtype(dtype)
    with staged_output(out) as staging:  # first: an unusable output directory fails at once
        model, run, path = load_checkpoint_model(checkpoint, requested)
        stored = stored_dtype(path, model)
        chosen = stored if chosen is None else chosen
        cfg = run.model
        tokenizer = (tokenizer or run.data.tokenizer_model) if with_tokenizer else None
        if tokenizer is not None and not Path(tokenizer).exists():
            source = "--tokenizer" if tokenizer != run.data.tokenizer_model else \
                "the run's data.tokenizer_model"
            raise ConversionError(f"{tokenizer}: tokenizer file not found ({source}); pass "
                                  "--tokenizer PATH, or --no-tokenizer")
        ids = probe_ids(cfg.vocab_size, probe_length(cfg))
        exact = probe_logits(model, ids)
        # Rounded to float32 or to the dtype they are stored in, the weights stay as they are.
        expected = exact if chosen in (torch.float32, stored) else \
            probe_logits(_round_weights(model, chosen), ids)
        reference = reference_state_dict(weights(model), cfg)
        del model
        family, why_not_native = native_family(cfg)
        special_tokens = {"bos_token_id": None, "eos_token_id": run.data.eod_id}
        if tokenizer is not None:
            from megaloop.hf.tokenizer import write_tokenizer

            special_tokens = write_tokenizer(tokenizer, staging, cfg.vocab_size)
        converted = hf_model(cfg, reference, special_tokens).to(chosen)
        converted.save_pretrained(staging)
        del converted
        GenerationConfig(**special_tokens, pad_token_id=special_tokens["eos_token_id"],
                         do_sample=False).save_pretrained(staging)
        if family is None:
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(REFERENCE_DIR / name, staging / name)
        what = f"{out} (from {path})"
        # The mapping check: fp32 on both sides, the same (rounded) weights on both sides, so the
        # fp32 tolerance holds at any dtype and size, and a wrong mapping fails as in fp32.
        loaded = AutoModelForCausalLM.from_pretrained(staging, trust_remote_code=family is None,
                                                      dtype=torch.float32)
        difference = compare_logits(expected, probe_logits(loaded, ids), what)
        class_name = type(loaded).__name__
        del loaded
        in_dtype = difference if chosen == torch.float32 else \
            _difference_as_loaded(staging, family is None, ids, exact, what)
    return {"checkpoint": str(path), "output": str(out), "class": class_name,
            "remote_code": family is None, "why_remote_code": why_not_native or None,
            "dtype": str(chosen).removeprefix("torch."),
            "safetensors_bytes": sum(f.stat().st_size for f in Path(out).glob("*.safetensors")),
            "probe_max_abs_difference": difference,
            "probe_max_abs_difference_in_dtype": in_dtype,
            "tokenizer": str(tokenizer) if tokenizer else None}


def _round_weights(model, dtype: torch.dtype):
    """``model`` with each weight rounded to ``dtype`` in place (kept in fp32): the values the
    export stores. A weight beyond the dtype's range (float16's 65504) is a ConversionError."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                rounded = tensor.to(dtype)
                if not bool(torch.isfinite(rounded).all()):
                    raise ConversionError(f"tensor {name}: values up to {tensor.abs().max():.3g}, "
                                          f"beyond {dtype}'s range; export in bfloat16 or "
                                          "float32")
                tensor.copy_(rounded)
    return model


def _difference_as_loaded(directory: Path, remote_code: bool, ids: torch.Tensor,
                          exact: torch.Tensor, what: str) -> float:
    """Largest difference between the checkpoint's fp32 logits and the export's, loaded as a user
    loads it (in config.json's dtype) and computing in that dtype. Reported, not bounded: rounding
    grows with depth, width and the weights' scale, so no bound measured on small models holds
    for every model. Logits that are not finite (float16 overflows at 65504) fail."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=remote_code)
    logits = probe_logits(model, ids)
    if not bool(torch.isfinite(logits).all()):
        raise ProbeMismatch(f"{what}: probe logits in {model.dtype} are not finite (overflow); "
                            "export in bfloat16 or float32")
    return (logits - exact).abs().max().item()
