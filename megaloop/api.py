"""One-call model construction for notebooks and quick checks (single process, CPU or one GPU).

    import megaloop.api as ml
    model = ml.build("tiny", arch="asymloop", iterations=3)
    logits = model(tokens)                       # [B, N, V]
    losses = model(tokens, labels=labels)        # per-token cross-entropy [B, N]
    deeper = model(tokens, num_iterations=6)     # test-time depth
    trained = ml.load("runs/asym/checkpoints")   # a checkpoint's model and weights
"""

from __future__ import annotations

import os

import torch


def build(preset_name: str = "tiny", *, seed: int = 1234, **overrides):
    """Builds preset ``preset_name`` with ``ModelConfig`` field overrides in this process.

    Sets up a one-process group (gloo on CPU) and megatron-core's parallel state unless a process
    group already exists, in which case the caller's setup is used as it is. On a GPU the model
    is on the current device (its inputs go there too).
    """
    from megaloop.presets import preset

    return _on_device(_build(preset(preset_name, **overrides), seed))


def _build(cfg, seed: int, initialize: bool = True):
    from megatron.core import parallel_state, tensor_parallel

    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        init_distributed(seed=seed)
    # Reseeded on every call: the same seed gives the same weights however often build() is called.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_model(cfg, initialize=initialize)


def load(checkpoint: str | os.PathLike, **overrides):
    """The model of a megaloop checkpoint, with its weights, in eval mode in this process.

    ``checkpoint``: an ``iter_N`` directory, or a run's checkpoint directory (its ``latest`` is
    taken); any tensor/pipeline layout it was saved in is resharded to this process. ``overrides``
    may set the ModelConfig fields a loaded checkpoint lets change
    (``checkpoint.RESUMABLE_MODEL_FIELDS``: ``iterations`` for test-time depth, which Dense and
    LatentLoop refuse as ``ModelConfig.depth_refusal`` says, the attention kernel, ...). Raises
    CheckpointError naming the path or file when the checkpoint is missing or incomplete,
    ConfigError for an override of a field the weights fix, a depth the model cannot run, or an
    initial value the loaded weights replace (``init_std``; ``residual_scale_init`` of learned
    scales).
    On a GPU the model is moved to the current device.
    """
    return load_with(_build_on_device, checkpoint, **overrides)


def _build_on_device(cfg):
    return _on_device(_build(cfg, seed=0, initialize=False))  # every weight is loaded next


def _on_device(model):
    """``model`` on this process's device, whole: on a GPU megatron-core makes its layers there,
    but megaloop's local-spec norms, LatentLoop's scales and the MoE routers on the CPU."""
    from megaloop.training.collective import collective_device

    return model.to(collective_device())


def load_with(build, checkpoint: str | os.PathLike, *, export: bool = False, **overrides):
    """``load`` with the model made by ``build(model config)`` (megaloop.hf converts on the CPU,
    one process, megatron-core's local spec); its documentation holds for both. ``build`` need not
    initialise the weights (``build_model(..., initialize=False)``): every tensor of the model's
    state dict is set to NaN (or, not being floating point, must be in the loaded state), and one
    the checkpoint leaves so is a CheckpointError naming it. ``export``: the caller writes the
    overrides into an export's configuration and reports them (megaloop.hf), so ``init_std`` is
    taken too: config.json's ``initializer_range``, which transformers initialises the weights it
    makes itself with (resize_token_embeddings). Learned scales' ``residual_scale_init`` is
    without effect there too (the file holds the scales; from_pretrained refuses it alike)."""
    import dataclasses

    from megaloop.config import ConfigError, ModelConfig, check_field_names
    from megaloop.training import checkpoint as ckpt
    from megaloop.training.weight_loading import check_all_loaded, mark_unloaded

    check_field_names(ModelConfig, overrides, "model")  # a typo is not a field the weights fix
    path = ckpt.find_checkpoint(checkpoint)
    ckpt.verify_checkpoint(path)
    fixed = [name for name in overrides if name not in ckpt.RESUMABLE_MODEL_FIELDS]
    if fixed:
        raise ConfigError(f"model.{fixed[0]}: fixed by the checkpoint {path}; a loaded model may "
                          f"change only {', '.join(ckpt.RESUMABLE_MODEL_FIELDS)}")
    cfg = ckpt.saved_section(path, ModelConfig, "model")
    depth = overrides.get("iterations")
    problem = None if depth is None else cfg.depth_refusal(depth)
    if problem:  # a MoE Loop's fixed scales are no weights: nothing else would notice
        raise ConfigError(f"model.iterations={depth}: {path}: {problem}")
    # Taken, they would change model.cfg, not the model.
    for name, why in cfg.replaced_by_loaded_weights().items():
        if name in overrides and overrides[name] != getattr(cfg, name) and not (
                export and name == "init_std"):
            raise ConfigError(f"model.{name}={overrides[name]!r}: {path}: without effect on a "
                              f"loaded model ({why})")
    model = build(dataclasses.replace(cfg, **overrides))
    mark_unloaded(model)
    state = ckpt.load_checkpoint(path, {"model": model.sharded_state_dict()})
    check_all_loaded(model, model.load_state_dict(state["model"], strict=False), path)
    return model.eval()
