"""Exports of checkpoints saved under tensor, pipeline and expert parallelism (2 gloo ranks) give
the logits those parallel models compute, to 1e-4 in fp32: the conversion reshards correctly."""

from pathlib import Path

import pytest
import torch
import yaml

from megaloop.config import ParallelConfig
from tests.distributed import run_distributed
from tests.hf.exports import perturb_norms, sample_tokens, variant_config

LAYOUTS = {  # pipelining: every architecture but LatentLoop
    "tp2": (ParallelConfig(tensor=2), ["dense", "fullloop", "asymloop", "latentloop"]),
    "pp2": (ParallelConfig(pipeline=2), ["dense", "fullloop", "asymloop"]),
    "ep2": (ParallelConfig(expert=2), ["asymloop_moe", "latentloop_moe"]),
}


def _logits_step(data_iterator, model):
    out = model(next(data_iterator))
    return out, lambda logits: (logits.sum() * 0, {"logits": logits.detach()})


def _save_under_layout(rank, world_size, parallel, variants, root):
    """Builds each variant under ``parallel``, runs the probe tokens through megatron-core's
    schedule (pipelined where PP > 1) and saves a checkpoint; returns the logits where they are."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megaloop.config import DataConfig, RunConfig
    from megaloop.models.model import build_model
    from megaloop.models.pipeline import schedule_shapes
    from megaloop.platform.distributed import init_distributed
    from megaloop.training.checkpoint import save_checkpoint

    init_distributed(parallel.tensor, parallel.pipeline, parallel.expert, seed=1234)
    found = {}
    for name in variants:
        cfg = variant_config(name)
        model = build_model(cfg, parallel, use_te=False, parallel_output=False,
                            stage=ps.get_pipeline_model_parallel_rank()).eval()
        perturb_norms(model)
        if parallel.pipeline > 1:  # the tied decoder copies start equal, as the trainer makes them
            from megaloop.training.tied import TiedCopies

            TiedCopies([model], parallel.pipeline, ps.get_pipeline_model_parallel_group()
                       ).sync_weights()
        x = sample_tokens(cfg)
        with torch.no_grad():
            result = get_forward_backward_func()(
                forward_step_func=_logits_step, data_iterator=iter([x]), model=[model],
                num_microbatches=1, micro_batch_size=x.shape[0], forward_only=True,
                **schedule_shapes(model, cfg.seq_length, parallel.pipeline))
        if ps.is_pipeline_last_stage():
            found[name] = result[0]["logits"]
        run = RunConfig(model=cfg, parallel=parallel, data=DataConfig(eod_id=3))
        save_checkpoint(Path(root) / name, 0, {"model": model.sharded_state_dict()}, run,
                        keep_last=1)
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_of_a_parallel_checkpoint_gives_its_logits(exports, layout, tmp_path):
    from transformers import AutoModelForCausalLM

    from megaloop.hf.to_hf import export_checkpoint

    parallel, variants = LAYOUTS[layout]
    per_rank = run_distributed(_save_under_layout, world_size=2, parallel=parallel,
                               variants=variants, root=str(tmp_path))
    for name in variants:
        expected = next(found[name] for found in per_rank if name in found)
        saved = yaml.safe_load((tmp_path / name / "iter_0000000" / "config.yaml").read_text())
        assert (saved["parallel"]["tensor"], saved["parallel"]["pipeline"],
                saved["parallel"]["expert"]) == (parallel.tensor, parallel.pipeline,
                                                 parallel.expert)
        export_checkpoint(tmp_path / name, tmp_path / f"{name}-hf")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-hf",
                                                     trust_remote_code=True)
        with torch.no_grad():
            logits = model(sample_tokens(variant_config(name)), use_cache=False).logits
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"{layout} {name}")
