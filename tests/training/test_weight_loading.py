"""Loading weights exactly and without a second copy: a load fills the model's own tensors (SwiGLU
input projections included, which megatron-core would concatenate into new ones), and a tensor it
leaves unfilled is found wherever its unfilled values are."""

import pytest
import torch

import megaloop.api as ml
from megaloop.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megaloop.training.weight_loading import check_all_loaded, merge_swiglu_in_place
from tests.models.variants import ALL_VARIANTS, SMALL


@pytest.mark.parametrize("variant", ["dense", "dense_moe_shared"])
def test_a_load_fills_the_models_own_tensors(mcore, tmp_path, variant):
    from megaloop.config import RunConfig

    model = ml.build("tiny", seed=3, **SMALL, **ALL_VARIANTS[variant])
    path = save_checkpoint(tmp_path, 1, {"model": model.sharded_state_dict()},
                           RunConfig(model=model.cfg), keep_last=1)
    loaded = load_checkpoint(path, {"model": model.sharded_state_dict()})["model"]
    own = {name: t for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    assert any("linear_fc1" in name for name in own)
    for name, tensor in own.items():
        assert loaded[name].data_ptr() == tensor.data_ptr(), name


def test_a_swiglu_merge_copies_halves_that_are_not_the_parameters_own():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    weight = torch.arange(12.0).view(4, 3)
    factory = apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("fc1", weight), ())
    merge = merge_swiglu_in_place({"fc1": factory})["fc1"].merge_fn
    own_halves = list(weight.chunk(2))
    assert merge(own_halves).data_ptr() == weight.data_ptr()
    copies = [half.clone() + 1 for half in own_halves]
    merged = merge(copies)
    assert merged.data_ptr() != weight.data_ptr() and torch.equal(merged, weight + 1)
    swapped = merge(own_halves[::-1])  # out of order: concatenated as given
    assert torch.equal(swapped, torch.cat([weight[2:], weight[:2]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("position", [0, 17, -1])
def test_an_unfilled_value_is_found_anywhere(tmp_path, dtype, position):
    layer = torch.nn.Linear(8, 4, dtype=dtype)
    result = layer.load_state_dict(layer.state_dict())
    check_all_loaded(layer, result, tmp_path)
    with torch.no_grad():
        layer.weight.view(-1)[position] = float("nan")
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}: did not fill the model's weight "):
        check_all_loaded(layer, result, tmp_path)
