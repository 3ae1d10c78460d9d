"""Hugging Face directory -> megaloop checkpoint (weights only).

Reads directories megaloop exported (model_type megaloop / megaloop_latentloop) and native Llama,
Qwen3, OLMo 2, Mixtral and Qwen3-MoE ones whose variant megaloop computes (megaloop.hf.native says
which fields must have which values). The weights are loaded by transformers from safetensors only,
into megaloop's own reference classes for megaloop directories: the directory's Python files are
never run. A tensor that is missing, unexpected or shaped otherwise than config.json says is a
one-line error naming it. The megaloop model is then filled a layer at a time, from the
safetensors where they hold a tensor under the loaded model's name (``import_hf``: memory).

The result is a checkpoint directory (iter_0000000 and ``latest``) that a run starts from with
``checkpoint.load=<dir> checkpoint.load_optimizer=false``; its config.yaml holds the model section
and, as data.eod_id, config.json's eos_token_id (so that exporting it again writes it; the
tokenizer itself is not carried: export with --tokenizer).
Before the rename into place, the checkpoint is loaded back and its logits on a probe input must
equal the Hugging Face model's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from megaloop.config import ConfigError, DataConfig, ModelConfig, RunConfig
from megaloop.hf.checkpoint import (build_single_process_model, load_checkpoint_model,
                                    save_weights_checkpoint, weights)
from megaloop.hf.common import (ConversionError, by_layer, compare_logits, holding_dtype,
                                probe_ids, probe_logits, staged_output)
from megaloop.hf.native import (FAMILIES, model_config_from_native, note_router_losses,
                                to_native_state_dict)
from megaloop.hf.to_hf import probe_length

MEGALOOP_MODEL_TYPES = ("megaloop", "megaloop_latentloop")
log = logging.getLogger("megaloop.hf")


def _megaloop_checkpoint_hint(directory: Path) -> str:
    """The other direction's input given to this one: say so, not only that config.json is
    missing (as to-hf does for a Hugging Face directory)."""
    from megaloop.training import checkpoint as ckpt

    try:
        ckpt.find_checkpoint(directory)
    except ckpt.CheckpointError:
        return ""
    return ("; it is a megaloop checkpoint: tools/convert_checkpoint.py to-hf converts that "
            "direction")


def read_config(directory: Path):
    """(transformers config, megaloop ModelConfig, model class, native family or None) of the
    Hugging Face directory's config.json; a ConversionError naming the file (and field) where it
    is missing, unreadable or describes no model megaloop computes."""
    import transformers

    from megaloop.models.export import reference_class
    from megaloop.reference.configuration_megaloop import LatentLoopConfig, MegaloopConfig

    config_file = directory / "config.json"
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConversionError(f"{config_file}: missing or unreadable ({e})"
                              + _megaloop_checkpoint_hint(directory)) from None
    if model_type in MEGALOOP_MODEL_TYPES:
        config_class = LatentLoopConfig if model_type == "megaloop_latentloop" else MegaloopConfig
        hf = config_class.from_pretrained(directory)
        cfg = _megaloop_model_config(hf, config_file)
        return hf, cfg, reference_class(cfg), None
    if model_type not in FAMILIES:
        raise ConversionError(f"{config_file}: model_type={model_type!r}: megaloop imports "
                              f"{', '.join(MEGALOOP_MODEL_TYPES + tuple(FAMILIES))}")
    hf = transformers.AutoConfig.from_pretrained(directory)
    return hf, model_config_from_native(hf), getattr(transformers, FAMILIES[model_type]), model_type


# The reference configuration's names for ModelConfig fields (megaloop/reference).
_HF_NAMES = {"max_position_embeddings": "seq_length", "initializer_range": "init_std",
             "tie_word_embeddings": "tie_embeddings"}


def _megaloop_model_config(hf, config_file: Path) -> ModelConfig:
    """The ModelConfig of a megaloop export's configuration ``hf``. Its fields must have the types
    and choices a run config allows, and hold what megaloop reads them as (an export writes them
    resolved): an edited field the reference model would read otherwise (``iterations: null``) is
    a ConversionError naming it, not a failure inside the model."""
    import inspect

    from megaloop.config import from_dict
    from megaloop.models.export import model_config, reference_config
    from megaloop.reference.configuration_megaloop import MegaloopConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    given = hf.to_dict()
    try:
        from_dict(ModelConfig, {_HF_NAMES.get(k, k): v for k, v in given.items()
                                if _HF_NAMES.get(k, k) in fields})
    except ConfigError as e:
        raise ConversionError(f"{config_file}: {e}") from None
    cfg = model_config(hf)
    resolved = reference_config(cfg).to_dict()
    for name in inspect.signature(MegaloopConfig.__init__).parameters:
        if name in resolved and name in given and given[name] != resolved[name]:
            raise ConversionError(f"{config_file}: {name}={given[name]!r}: megaloop reads this "
                                  f"model as {name}={resolved[name]!r}; write that")
    return cfg


def load_hf_model(directory: str | Path):
    """(Hugging Face model in fp32, megaloop ModelConfig, native family or None)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConversionError(f"{directory}: no such directory")
    hf_config, cfg, model_class, family = read_config(directory)
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConversionError(f"{directory / 'config.json'}: {e}") from None
    _check_safetensors_headers(directory)
    try:
        model, info = model_class.from_pretrained(
            directory, config=hf_config, dtype=torch.float32, use_safetensors=True,
            ignore_mismatched_sizes=True, output_loading_info=True)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{directory}: no loadable safetensors weights "
                              f"({str(e).strip().splitlines()[0]})") from None
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda entry: entry[0])
    if mismatched:
        name, saved, expected = mismatched[0]
        raise ConversionError(f"{directory}: tensor {name}: shape {tuple(saved)} in the "
                              f"safetensors, config.json gives {tuple(expected)}"
                              f"{_more(mismatched)}")
    for key, problem in (("missing_keys", "missing from the safetensors files"),
                         ("unexpected_keys", "not part of the model config.json describes")):
        names = sorted(info.get(key) or ())
        if names:
            raise ConversionError(f"{directory}: tensor {names[0]}: {problem}{_more(names)}")
    _check_tied(model, cfg, directory)
    return model.eval(), cfg, family


def _check_tied(model, cfg: ModelConfig, directory: Path) -> None:
    """transformers loads an output layer the safetensors hold even where config.json ties it to
    the embedding; megaloop would tie it, computing another function."""
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if cfg.tie_embeddings and head is not embedding and not torch.equal(head, embedding):
        name = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is head)
        raise ConversionError(f"{directory}: tensor {name}: differs from the embedding, which "
                              "config.json's tie_word_embeddings=true makes it; set that false, "
                              f"or leave {name} out")


def _check_safetensors_headers(directory: Path) -> None:
    """Each safetensors file of ``directory`` opens (its header parses and covers the file): a
    truncated or corrupted one is a ConversionError naming it, where transformers would fail with
    a message naming no file."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{file}: not a readable safetensors file (truncated or "
                                  f"corrupted? {e})") from None


def safetensors_dtype(directory: Path) -> torch.dtype:
    """The dtype the directory's safetensors hold the weights in (as ``holding_dtype`` says)."""
    from safetensors import safe_open

    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    floating = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as tensors:
            floating |= {names.get(kind, kind) for kind in
                         (tensors.get_slice(name).get_dtype() for name in tensors.keys())
                         if kind.startswith(("F", "BF"))}
    return holding_dtype(floating)


def _more(items) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


class _HuggingFaceTensors:
    """The tensors of a loaded Hugging Face model ``hf`` by its names, each handed out once, in
    fp32: read from ``directory``'s safetensors where a file holds the tensor under that name (the
    file mapped only while a group of them is read), else the loaded tensor itself (kept: what
    transformers builds on load, such as a native MoE class's stacked experts). A tensor tied to
    another (a tied head) is read as that one. So, once ``hf`` is deleted, no more than a group
    of the weights is held here at a time, however transformers holds them."""

    def __init__(self, hf, directory: Path):
        from safetensors import safe_open

        self.file_of, self.kept, self.tied = {}, {}, {}
        in_files = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(file, framework="pt") as tensors:
                in_files.update(dict.fromkeys(tensors.keys(), file))
        same = {}  # tensors sharing one storage: a file's name first
        for name, tensor in sorted(hf.state_dict().items(), key=lambda item: item[0] not in
                                   in_files):
            first = same.setdefault((tensor.data_ptr(), tensor.shape), name)
            if first != name:
                self.tied[name] = first
            elif name in in_files:
                self.file_of[name] = in_files[name]
            else:
                self.kept[name] = tensor.detach()
        self.left = {*self.file_of, *self.kept, *self.tied}

    def take(self, names) -> dict[str, torch.Tensor]:
        """The tensors of ``names`` that the model has (a missing one is left out)."""
        from safetensors import safe_open

        names = [name for name in names if name in self.left]
        self.left.difference_update(names)
        sources = {name: self.tied.get(name, name) for name in names}
        read = {source: self.kept.pop(source).float() for source in set(sources.values())
                if source in self.kept}
        for file in {self.file_of[s] for s in sources.values() if s not in read}:
            with safe_open(file, framework="pt") as tensors:  # copied out before it is unmapped
                read.update({source: tensors.get_tensor(source).to(torch.float32, copy=True)
                             for source in set(sources.values()) - set(read)
                             if self.file_of[source] == file})
        return {name: read[source] for name, source in sources.items()}


def _fill(params: dict[str, torch.Tensor], tensors: _HuggingFaceTensors, cfg: ModelConfig,
          family: str | None) -> None:
    """Writes megatron-core tensors ``params`` (a group of ``by_layer`` of a model of ``cfg``)
    from the Hugging Face tensors they map to (a ValueError naming one that is missing or
    shaped otherwise)."""
    from megaloop.models.export import invert_mapping, reference_state_dict

    def mapping(state):
        mapped = reference_state_dict(state, cfg)
        return mapped if family is None else to_native_state_dict(mapped, family)

    shapes = {name: tuple(tensor.shape) for name, tensor in params.items()}
    wanted = mapping({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    for name, tensor in invert_mapping(mapping, tensors.take(wanted), shapes).items():
        params[name].copy_(tensor)


def document_end(eos_token_id, directory: Path) -> int | None:
    """config.json's eos_token_id, kept as the run's data.eod_id so that exporting the checkpoint
    again writes it. A list (Llama 3.1 Instruct: end of text, end of message, end of turn) keeps
    its first, the end of text of pretraining documents, and says so: megaloop has one end of
    document, and a second export's generate() stops at it only."""
    if isinstance(eos_token_id, list) and eos_token_id:
        log.warning("%s: config.json's eos_token_id is a list %s; data.eod_id is its first, %s, and "
                    "an export of this checkpoint stops generating at that one only",
                    directory / "config.json", eos_token_id, eos_token_id[0])
        eos_token_id = eos_token_id[0]
    return eos_token_id if isinstance(eos_token_id, int) else None


def import_hf(directory: str | Path, out: str | Path) -> dict:
    """Converts the Hugging Face directory into the megaloop checkpoint directory ``out``; returns
    a report (architecture, probe difference).

    Memory: about one fp32 copy of the weights at a time. The Hugging Face model is loaded for
    its probe logits and deleted; the megatron-core model is built uninitialised (its memory is
    taken as it is written) and filled a layer at a time from the safetensors (``by_layer``,
    ``_HuggingFaceTensors``); it is deleted once saved, before the checkpoint is read back."""
    directory = Path(directory)
    with staged_output(out) as staging:  # first: an unusable output directory fails at once
        hf, cfg, family = load_hf_model(directory)
        if family is not None:
            note_router_losses(cfg)
        data = DataConfig(eod_id=document_end(hf.config.eos_token_id, directory))
        ids = probe_ids(cfg.vocab_size, probe_length(cfg))
        expected = probe_logits(hf, ids)
        tensors = _HuggingFaceTensors(hf, directory)
        del hf
        model = build_single_process_model(cfg, initialize=False)  # every weight written below
        params = weights(model)
        try:
            for names in by_layer(list(params)):
                _fill({name: params.pop(name) for name in names}, tensors, cfg, family)
            if tensors.left:
                raise ValueError(f"tensor {sorted(tensors.left)[0]}: not part of this "
                                 "architecture")
        except ValueError as e:
            raise ConversionError(f"{directory}: {e}") from None
        dtype = safetensors_dtype(directory)  # kept: the checkpoint is no larger than HF's
        path = save_weights_checkpoint(model.to(dtype), RunConfig(model=cfg, data=data), staging)
        del model
        reloaded, _, _ = load_checkpoint_model(path)  # uninitialised, every tensor checked loaded
        difference = compare_logits(expected, probe_logits(reloaded, ids),
                                    f"{out} (from {directory})")
    return {"source": str(directory), "output": str(out), "arch": cfg.arch,
            "native_family": family, "dtype": str(dtype).removeprefix("torch."),
            "eod_id": data.eod_id, "probe_max_abs_difference": difference}
