"""The megaloop side of a conversion: a dist checkpoint of any layout read into one process, and a
weights-only checkpoint written from one.

megatron-core's dist_checkpointing reshards on load: a model built with tensor, pipeline and expert
parallel size 1 loads a checkpoint saved under any TP/PP/EP layout (tensors are stored with their
global shapes and keys that do not depend on the layout).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from megaloop.config import DataConfig, ModelConfig, ParallelConfig, RunConfig
from megaloop.hf.common import ConversionError, holding_dtype
from megaloop.training import checkpoint as ckpt


def checkpoint_path(path: str | Path) -> Path:
    """A checkpoint directory (``iter_N`` with config.yaml), or a checkpoint directory holding a
    ``latest`` pointer (or that pointer itself), resolved to the checkpoint itself."""
    path = Path(path)
    if path.name == ckpt.LATEST and path.is_file():
        path = path.parent
    if path.is_file():
        raise ConversionError(f"{path}: a file, not a checkpoint directory (give an iter_N "
                              f"directory, or the directory holding '{ckpt.LATEST}')")
    if not path.is_dir():
        raise ConversionError(f"{path}: no such checkpoint directory")
    complete = [p for p in ckpt.complete_checkpoints(path) if (p / "config.yaml").is_file()]
    if complete and not (path / ckpt.LATEST).exists():
        # A resume takes the newest then, saying so; a conversion names it instead of guessing.
        raise ConversionError(f"{path}: no '{ckpt.LATEST}' pointer beside its checkpoints; give "
                              f"the one to convert, e.g. the newest, {complete[-1]}")
    try:
        return ckpt.find_checkpoint(path)
    except ckpt.CheckpointError as e:
        # The other direction's input given to this one: say so, not only that nothing is there.
        hf_files = [name for name in ("config.json", "*.safetensors") if any(path.glob(name))]
        if not hf_files:
            raise
        raise ckpt.CheckpointError(
            f"{e}; it holds {' and '.join(hf_files)}, as a Hugging Face model does: "
            "tools/convert_checkpoint.py from-hf converts that direction") from None


@contextlib.contextmanager
def still_there(path: Path):
    """Reading checkpoint ``path``: an error once ``path`` is gone is a ConversionError saying so.
    A run still writing its directory removes its older checkpoints (checkpoint.keep_last) while
    a conversion reads one, which otherwise fails on whichever file went first ("iter_N: no such
    checkpoint directory", a missing .distcp), as if the user had named a wrong one."""
    try:
        yield
    except (ConversionError, ckpt.CheckpointError, OSError):
        if path.is_dir():
            raise
        now = None
        with contextlib.suppress(ckpt.CheckpointError, OSError):
            now = ckpt.latest_checkpoint(path.parent)
        latest = f"; '{ckpt.LATEST}' now names {now.name}" if now is not None else ""
        raise ConversionError(f"{path}: removed while it was being read (a run still writing "
                              f"{path.parent} prunes older checkpoints, checkpoint.keep_last)"
                              f"{latest}: convert again, or copy a checkpoint out of the run "
                              "first") from None


def build_single_process_model(cfg: ModelConfig, initialize: bool = True):
    """A TP=PP=EP=1 model of ``cfg``, wholly on the CPU with megatron-core's local spec (also on a
    GPU machine: a conversion is a CPU job), torch.distributed initialised for one process if it
    is not already; ``initialize=False``: weights left unset, to be loaded."""
    from megatron.core import parallel_state as ps

    from megaloop.models.build_device import built_on_cpu
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    if not ps.model_parallel_is_initialized():
        init_distributed()
    sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
             ps.get_expert_model_parallel_world_size())
    if sizes != (1, 1, 1):
        raise ConversionError(f"conversions run in one process; this one has tensor/pipeline/"
                              f"expert parallel sizes {sizes}")
    with built_on_cpu():
        model = build_model(cfg, ParallelConfig(), use_te=False, initialize=initialize)
    return model.eval()


def requested_settings(path: Path, requested: ModelConfig) -> dict[str, tuple]:
    """{field: (the checkpoint's value, ``requested``'s)} of each setting in which the model
    config ``requested`` (a ``--config``'s) differs from checkpoint ``path``'s and which a loaded
    checkpoint lets change (``checkpoint.RESUMABLE_MODEL_FIELDS``, as a resume and
    ``megaloop.api.load`` apply them). Another architecture is a CheckpointError naming every
    field that differs.

    Applied, not refused: exporting a looped model to run at another depth (``iterations``), with
    a longer context (``seq_length``, ``rotary_base``) or another routing width is what these
    fields are changeable for; the export's config.json then holds the requested values and its
    probe logits are checked against the checkpoint's model built with them. The others
    (the attention kernel and loss weights, which a remote-code config.json carries for an
    import and no Hugging Face model reads; the initialisation scale, transformers' for weights
    it makes itself) change no logit; applied alike, they are reported with the rest. Learned
    scales' residual_scale_init, which the file's scales replace, is refused when the checkpoint
    is loaded (``megaloop.api.load_with``)."""
    ckpt.check_compatible(path, RunConfig(model=requested))
    saved = vars(ckpt.saved_section(path, ModelConfig, "model").resolve())
    wanted = vars(dataclasses.replace(requested).resolve())
    return {name: (saved[name], wanted[name]) for name in ckpt.RESUMABLE_MODEL_FIELDS
            if saved[name] != wanted[name]}


def load_checkpoint_model(path: str | Path, **overrides):
    """(model, run config, checkpoint path): the checkpoint's weights in a single-process model
    (``megaloop.api.load`` on the CPU, megatron-core's local spec); the run config holds the
    checkpoint's model and data sections, the model's with ``overrides`` (ModelConfig fields that
    a loaded checkpoint lets change, e.g. from ``requested_settings``)."""
    from megaloop.api import load_with

    path = checkpoint_path(path)
    # initialize=False: every weight is filled by the checkpoint
    model = load_with(lambda cfg: build_single_process_model(cfg, initialize=False), path,
                      export=True, **overrides)
    return model, RunConfig(model=model.cfg, data=ckpt.saved_section(path, DataConfig, "data")), \
        path


def stored_dtype(path: Path, model) -> torch.dtype:
    """The dtype checkpoint ``path`` holds ``model``'s weights in (bfloat16 after a bf16 run: the
    fp32 main weights are optimizer state), float32 where it holds them in several."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return holding_dtype({stored[tensor.key].properties.dtype for tensor in
                          nested_values(model.sharded_state_dict())
                          if isinstance(tensor, ShardedTensor)})


def weights(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A single-process model's tensors (in ``dtype``, on the CPU: the model's own tensors where
    they are so already), without Transformer Engine's extra state."""
    return {name: tensor.detach().to("cpu", dtype) for name, tensor in model.state_dict().items()
            if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state")}


def save_weights_checkpoint(model, run: RunConfig, directory: Path) -> Path:
    """Writes ``model``'s weights as step 0 of checkpoint directory ``directory`` (iter_0000000 and
    the ``latest`` pointer): what ``checkpoint.load`` starts a run from, with
    ``checkpoint.load_optimizer=false`` (there is no optimizer state or progress)."""
    run = dataclasses.replace(run, model=dataclasses.replace(run.model).resolve())
    return ckpt.save_checkpoint(directory, 0, {"model": model.sharded_state_dict()}, run,
                                keep_last=1)
