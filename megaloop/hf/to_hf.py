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

import logging
import re
import shutil
from pathlib import Path

import torch

from megaloop.config import ModelConfig
from megaloop.hf.checkpoint import (checkpoint_path, load_checkpoint_model, requested_settings,
                                    still_there, stored_dtype, weights)
from megaloop.hf.common import (ConversionError, ProbeMismatch, by_layer, compare_logits,
                                export_dtype, probe_ids, probe_logits, staged_output)
from megaloop.hf.native import (FAMILIES, native_config, native_family, note_router_losses,
                                to_native_state_dict)

log = logging.getLogger("megaloop.hf")

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"
# Shipped as remote code: the configuration and every modeling file (they import one another).
REMOTE_CODE_FILES = ("configuration_megaloop.py", "modeling_asymloop.py", "modeling_moe.py",
                     "modeling_latentloop.py")


def probe_length(cfg: ModelConfig) -> int:
    """An odd length (a LatentLoop tail of incomplete latents is part of the probe) within the
    trained context."""
    return max(1, min(cfg.seq_length, 64) - 1)


def reference_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """``reference_state_dict`` of a model's tensors ``state``, which it empties: one layer at a
    time (``by_layer``), each layer's tensors released once mapped, and every result owning its
    storage. So the fused tensors' copies (a q/k/v split of interleaved query groups) never sit
    beside all the originals, and no result is a view that transformers' save_pretrained would
    copy (it clones tensors sharing a storage, e.g. the SwiGLU gate and up halves of one fused
    weight)."""
    from megaloop.models.export import reference_state_dict

    reference = {}
    for names in by_layer(list(state)):
        mapped = reference_state_dict({n: state.pop(n) for n in names}, cfg)
        reference.update({name: _owning(tensor) for name, tensor in mapped.items()})
    return reference


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where it is a view of part of a larger storage."""
    whole = tensor.is_contiguous() and tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole else tensor.clone()


def hf_model(cfg: ModelConfig, reference: dict[str, torch.Tensor], special_tokens: dict):
    """(the Hugging Face model, built without storage in the dtype of ``reference``; its tensors as
    its safetensors hold them) of ``reference`` (the reference model's tensors, in the dtype to
    export), which it empties: a native class where ``native_family`` finds one, else the
    reference model with its ``auto_map``.

    The file holds the layout of the original checkpoints, which transformers' save_pretrained
    writes by reverting its load-time conversions (a native MoE class's stacked experts unstacked
    per expert). Reverted here a layer at a time (``revert_weight_conversion``), each result owning
    its storage, so that no more than a layer's temporary copies exist at once: save_pretrained
    reverts the whole model at once, copying the experts' halves out of every layer's stacked
    gate_up_proj beside the stacked tensors. The names and shapes must be the ones the model
    would save (a mapping bug is a RuntimeError naming the first difference)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from megaloop.models.export import reference_class, reference_config

    family, _ = native_family(cfg)
    if family is not None:
        model_class = getattr(transformers, FAMILIES[family])
        config = native_config(cfg, family, special_tokens)
        note_router_losses(cfg)
    else:
        config = reference_config(cfg)
        config.update(special_tokens)
        model_class = reference_class(cfg)
        config.auto_map = {"AutoConfig": f"configuration_megaloop.{type(config).__name__}",
                           "AutoModelForCausalLM": f"{model_class.__module__.rsplit('.', 1)[1]}."
                                                   f"{model_class.__name__}"}
    with torch.device("meta"):
        model = model_class(config).to(next(iter(reference.values())).dtype)
    layers = {}
    for name in reference:  # "<block>.<i>" of a layer, or "" (embedding, final norm, head, ...)
        layer = re.match(r"^(.*?\.\d+)\.", name)
        layers.setdefault(layer.group(1) if layer else "", []).append(name)
    state = {}
    for names in layers.values():
        group = {n: reference.pop(n) for n in names}
        native = group if family is None else to_native_state_dict(group, family)
        del group
        state.update({name: _owning(tensor) for name, tensor in
                      revert_weight_conversion(model, native).items()})
    _check_saved_names(state, revert_weight_conversion(model, model.state_dict()))
    return model, state


def _check_saved_names(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """A RuntimeError naming the first tensor of ``state`` missing from ``expected`` (what the
    model saves), not in it, or shaped otherwise."""
    for name in sorted(set(state) | set(expected)):
        if name not in state:
            raise RuntimeError(f"tensor {name}: not mapped; the Hugging Face model saves it "
                               f"(shape {tuple(expected[name].shape)})")
        if name not in expected:
            raise RuntimeError(f"tensor {name}: mapped, but the Hugging Face model saves no such "
                               "tensor")
        if state[name].shape != expected[name].shape:
            raise RuntimeError(f"tensor {name}: mapped with shape {tuple(state[name].shape)}, the "
                               f"Hugging Face model saves {tuple(expected[name].shape)}")


def export_checkpoint(checkpoint: str | Path, out: str | Path, *,
                      requested: ModelConfig | None = None, tokenizer: str | None = None,
                      with_tokenizer: bool = True, dtype: str | None = None) -> dict:
    """Converts ``checkpoint`` (any parallel layout) into the Hugging Face directory ``out``.

    ``requested`` (a run config's model): refuse a checkpoint of another architecture, and export
    with its settings that a loaded checkpoint lets change (``requested_settings``: the test-time
    depth, the context, ...), named in one warning line (trained and exported values) and
    listed in the report's ``settings_from_config``. ``tokenizer``: a tokenizer file in place of
    the run's ``data.tokenizer_model``; ``with_tokenizer=False`` writes none. ``dtype``
    (a DTYPES name): what the safetensors hold and config.json's ``dtype`` says, the dtype
    ``from_pretrained`` loads in; by default the one the checkpoint holds its weights in, which
    loses nothing. Returns a report (class, remote code or not and why, dtype, file size, probe
    differences, tokenizer).

    Memory: one copy of the weights at a time, about the fp32 size of the model (the checkpoint
    is read once, into fp32; the weights are cast to ``dtype`` in place, mapped to the Hugging
    Face names a layer at a time (``reference_tensors``) and handed to the Hugging Face model
    without a copy; the export is loaded back once, in its dtype, and cast to fp32 for the mapping
    check); a native MoE class's experts are unstacked a layer at a time (``hf_model``)."""
    from transformers import GenerationConfig

    chosen = None if dtype is None else export_dtype(dtype)
    with staged_output(out) as staging:  # first: an unusable output directory fails at once
        path = checkpoint_path(checkpoint)
        with still_there(path):  # its last read is stored_dtype's
            changed = {} if requested is None else requested_settings(path, requested)
            tokenizer, special_tokens, untokenized = _write_tokenizer(path, tokenizer,
                                                                      with_tokenizer, staging)
            model, run, path = load_checkpoint_model(
                path, **{name: value for name, (_, value) in changed.items()})
            # Once the model takes them (a depth it cannot run is refused there, in one line).
            if changed:  # config.json will hold them, not the values the weights were trained at
                log.warning("%s: exported with the config's model settings, not those it was "
                            "trained with: %s", path, ", ".join(
                                f"model.{name}={new!r} (trained: {old!r})"
                                for name, (old, new) in changed.items()))
            chosen = stored_dtype(path, model) if chosen is None else chosen
        cfg = run.model
        ids = probe_ids(cfg.vocab_size, probe_length(cfg))
        exact = probe_logits(model, ids)
        expected = exact if chosen == torch.float32 else \
            probe_logits(_round_weights(model, chosen), ids)
        # Rounded already, so the cast loses nothing; it replaces one tensor at a time.
        state = weights(model.to(chosen), chosen)
        del model  # its tensors are now state's alone, released as they are mapped
        reference = reference_tensors(state, cfg)
        family, why_not_native = native_family(cfg)
        converted, state = hf_model(cfg, reference, special_tokens)
        converted.save_pretrained(staging, state_dict=state, save_original_format=False)
        del converted, state
        GenerationConfig(**special_tokens, pad_token_id=special_tokens["eos_token_id"],
                         do_sample=False, **untokenized).save_pretrained(staging)
        if family is None:
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(REFERENCE_DIR / name, staging / name)
        class_name, difference, in_dtype = _check_loaded(staging, family is None, ids, exact,
                                                         expected, f"{out} (from {path})")
    return {"checkpoint": str(path), "output": str(out), "class": class_name,
            "remote_code": family is None, "why_remote_code": why_not_native or None,
            "dtype": str(chosen).removeprefix("torch."),
            "safetensors_bytes": sum(f.stat().st_size for f in Path(out).glob("*.safetensors")),
            "probe_max_abs_difference": difference,
            "probe_max_abs_difference_in_dtype": in_dtype,
            "tokenizer": str(tokenizer) if tokenizer else None,
            "settings_from_config": {f"model.{name}": {"checkpoint": old, "export": new}
                                     for name, (old, new) in changed.items()}}


def _write_tokenizer(path: Path, tokenizer: str | None, with_tokenizer: bool, staging: Path):
    """(the tokenizer file written into ``staging``, the special token ids, generation settings)
    of checkpoint ``path``: ``tokenizer``, else the run's data.tokenizer_model, if
    ``with_tokenizer``, encoding as the run's data.tokenizer_type and data.legacy_tokenizer do
    (eos: the EOD it trained). Read from the checkpoint's config alone, so that a missing or
    unsuitable tokenizer fails before the weights are read.

    The generation settings suppress the embedding rows past the tokenizer
    (megaloop.hf.tokenizer.untokenized_ids; without tokenizer files, past the size of the one the
    run trained with: ``_trained_tokenizer``)."""
    from megaloop.config import DataConfig
    from megaloop.training.checkpoint import saved_section

    data = saved_section(path, DataConfig, "data")
    vocab_size = saved_section(path, ModelConfig, "model").vocab_size
    if not with_tokenizer or (tokenizer is None and data.tokenizer_model is None):
        eod, tokens = _trained_tokenizer(path, data, vocab_size)
        untokenized = list(range(tokens, vocab_size))
        return None, {"bos_token_id": None, "eos_token_id": eod}, \
            {"suppress_tokens": untokenized} if untokenized else {}
    tokenizer = tokenizer or data.tokenizer_model
    if not Path(tokenizer).exists():
        source = "--tokenizer" if tokenizer != data.tokenizer_model else \
            "the run's data.tokenizer_model"
        raise ConversionError(f"{tokenizer}: tokenizer file not found ({source}); pass "
                              "--tokenizer PATH, or --no-tokenizer")
    from megaloop.hf.tokenizer import check_stands_in_for_runs, untokenized_ids, write_tokenizer

    check_stands_in_for_runs(tokenizer, data, tokenizer_type=data.tokenizer_type)
    special_tokens = write_tokenizer(tokenizer, staging, vocab_size, data.tokenizer_type,
                                     data.legacy_tokenizer)
    eod = special_tokens["eos_token_id"]
    if data.eod_id is not None and eod is not None and eod != data.eod_id:
        raise ConversionError(f"--tokenizer {tokenizer}: ends documents with id {eod}, the run's "
                              f"data.eod_id is {data.eod_id} (not the tokenizer this model was "
                              "trained with)")
    from transformers import AutoTokenizer  # before config.json is there (its auto_map)

    untokenized = untokenized_ids(AutoTokenizer.from_pretrained(staging), vocab_size)
    return tokenizer, special_tokens, {"suppress_tokens": untokenized} if untokenized else {}


def _trained_tokenizer(path: Path, data, vocab_size: int) -> tuple[int | None, int]:
    """(the end-of-document id, the number of tokens) of the tokenizer that run data section
    ``data`` of checkpoint ``path`` trained with, for an export without tokenizer files: its file
    where it is still there, else the sidecars tools/preprocess_data.py wrote beside its data.path
    prefixes (data.eod_id, else None, for the id: generate() still stops where the model learned
    to). A size known nowhere is ``vocab_size`` (the model's rows: none suppressed), said in one
    warning line: generate() may then choose an embedding row past the tokenizer."""
    from megaloop.data.datasets import parse_blend
    from megaloop.data.preprocess import read_sidecar

    if data.tokenizer_model is not None and Path(data.tokenizer_model).exists():
        from megaloop.data.tokenizer import load_tokenizer

        trained = load_tokenizer(data.tokenizer_type, data.tokenizer_model,
                                 legacy=data.legacy_tokenizer)
        return (data.eod_id if data.eod_id is not None else trained.eod), trained.vocab_size
    prefixes = parse_blend(data.path)[0] if data.format == "indexed" and data.path else []
    sizes = {record.get("vocab_size") for prefix in prefixes if (record := read_sidecar(prefix))}
    if len(sizes) == 1 and isinstance(size := next(iter(sizes)), int):
        return data.eod_id, size
    log.warning("%s: exported without tokenizer files, and the size of the tokenizer it was "
                "trained with is known nowhere (%s, and no data.path prefix has a tokenizer "
                "sidecar that says it): generation_config.json suppresses none of its %d "
                "embedding rows, so generate() may choose a padding row past the tokenizer; "
                "export with --tokenizer PATH to suppress them", path,
                "the run gave data.eod_id alone" if data.tokenizer_model is None else
                f"its data.tokenizer_model {data.tokenizer_model} is gone", vocab_size)
    return data.eod_id, vocab_size


def _round_weights(model, dtype: torch.dtype):
    """``model`` with each weight rounded to ``dtype`` in place (kept in fp32): the values the
    export stores. Buffers too: a fixed LatentLoop residual scale is no weight of the file, and
    the reference model computes it in the dtype it loads in. A weight beyond the dtype's range
    (float16's 65504) is a ConversionError."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point():
                rounded = tensor.to(dtype)
                if not bool(torch.isfinite(rounded).all()):
                    raise ConversionError(f"tensor {name}: values up to {tensor.abs().max():.3g}, "
                                          f"beyond {dtype}'s range; export in bfloat16 or "
                                          "float32")
                tensor.copy_(rounded)
    return model


def _check_loaded(directory: Path, remote_code: bool, ids: torch.Tensor, exact: torch.Tensor,
                  expected: torch.Tensor, what: str) -> tuple[str, float, float]:
    """(class name, largest probe difference in fp32, largest difference in the export's dtype)
    of the export, loaded once, as a user loads it (in config.json's dtype).

    In its dtype, the logits are compared with the checkpoint's fp32 ones (``exact``): reported,
    not bounded, since rounding grows with depth, width and the weights' scale, so no bound
    measured on small models holds for every model; logits that are not finite (float16
    overflows at 65504) fail. Cast to fp32 (exactly: every stored value is one), the model must
    give ``expected``, the megaloop model's logits with the same rounded weights, to the fp32
    tolerance: the mapping check, as strict at any dtype and size as in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=remote_code)
    dtype = model.dtype
    as_loaded = probe_logits(model, ids)
    if dtype != torch.float32:
        # The loaded tensors map the safetensors file, which stays mapped (and resident, once
        # read) until the last of them is gone; copied out of it first, the file goes before the
        # fp32 copies come, and each fp32 copy then frees its tensor at once.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.data = parameter.data.clone()
        model.float()
    difference = compare_logits(expected, probe_logits(model, ids), what)
    if not bool(torch.isfinite(as_loaded).all()):
        raise ProbeMismatch(f"{what}: probe logits in {dtype} are not finite (overflow); "
                            "export in bfloat16 or float32")
    return type(model).__name__, difference, (as_loaded - exact).abs().max().item()
