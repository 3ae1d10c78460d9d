"""Loading a checkpoint's weights into a model exactly, and without extra copies.

A model built only to be filled from a checkpoint skips random initialisation
(``build_model(..., initialize=False)``): its weights are whatever memory torch.empty gave them.
``mark_unloaded`` sets every floating-point tensor of its state dict to NaN first, and
``check_all_loaded`` refuses the model if any NaN is left after the load, so that a tensor the
checkpoint does not fill (a key the sharded state dict maps to nothing, an entry loaded as the
model's own tensor) can never pass as a weight. One write and one read of the weights: far less
than drawing them at random.

megatron-core saves a SwiGLU FFN's fused [gate; up] input projection as two tensors (so that
tensor parallelism can reshard each half) and on load concatenates the two loaded halves into a
new tensor, which ``load_state_dict`` then copies into the parameter: one extra copy of every
such projection alive until the copy. The halves are views of the parameter that the load fills in
place, so ``merge_swiglu_in_place`` makes that concatenation return the parameter itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

def mark_unloaded(model: torch.nn.Module) -> None:
    """Sets every floating-point tensor of ``model``'s state dict to NaN (see the module)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                tensor.fill_(float("nan"))


def _holds_nan(tensor: torch.Tensor) -> bool:
    # A maximum is NaN iff an element is (torch's reductions propagate NaN): one read of the
    # tensor, no temporary, several times faster than isnan().any().
    return tensor.numel() > 0 and bool(tensor.amax().isnan())


def check_all_loaded(model: torch.nn.Module, result, path: Path) -> None:
    """Raises a CheckpointError naming the first tensor of ``model``'s state dict that the load
    from checkpoint ``path`` left unfilled: missing from the loaded state (``result``, what
    ``load_state_dict(strict=False)`` returned), or still NaN after ``mark_unloaded``."""
    from megaloop.training.checkpoint import CheckpointError

    if result.missing_keys:
        raise CheckpointError(f"{path}: holds no value for the model's {result.missing_keys[0]}")
    if result.unexpected_keys:
        raise CheckpointError(f"{path}: loaded {result.unexpected_keys[0]}, which the model does "
                              "not have")
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and _holds_nan(tensor):
            raise CheckpointError(f"{path}: did not fill the model's {name} (NaN where its "
                                  "values belong: not loaded from the checkpoint, or NaN there)")


def _tiles(pieces: list, whole: torch.Tensor) -> bool:
    """Whether ``pieces`` are contiguous views laid one after the other over contiguous ``whole``,
    so that their concatenation along dim 0 holds exactly ``whole``'s values."""
    if not (isinstance(pieces, list) and whole.is_contiguous()
            and all(isinstance(p, torch.Tensor) and p.is_contiguous() and p.dtype == whole.dtype
                    and p.device == whole.device and p.shape[1:] == whole.shape[1:]
                    for p in pieces)):
        return False
    address = whole.data_ptr()
    for piece in pieces:
        if piece.data_ptr() != address:
            return False
        address += piece.numel() * piece.element_size()
    return sum(p.shape[0] for p in pieces) == whole.shape[0]


def _merge_into(parameter: torch.Tensor, merge):
    def merge_in_place(pieces):
        return parameter if _tiles(pieces, parameter) else merge(pieces)

    return merge_in_place


def merge_swiglu_in_place(sharded_state: dict) -> dict:
    """``sharded_state`` with megatron-core's SwiGLU factories merging the loaded halves into the
    parameter they are views of, where the load filled them in place (else as before: a copy)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for entry in nested_values(sharded_state):
        if (isinstance(entry, ShardedTensorFactory) and entry.data is not None
                and entry.merge_fn.__qualname__.startswith("apply_swiglu_sharded_factory.")):
            entry.merge_fn = _merge_into(entry.data.detach(), entry.merge_fn)
    return sharded_state
