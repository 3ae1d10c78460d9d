"""Tensor parallelism is invisible to the maths: TP=2 logits and gradients equal TP=1, with and
without sequence parallelism (the local spec's norms, the Global KV projection and the joint
attention under a sequence split over the TP ranks)."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.models.variants import small_config


def _full_gradients(model, tp_size: int) -> dict:
    """Each parameter's gradient as the TP=1 model would hold it."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.module.named_parameters():
        grad = p.main_grad
        if tp_size > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(tp_size)]
            torch.distributed.all_gather(parts, grad.contiguous(), group=group)
            if name.endswith("linear_fc1.weight"):  # each rank holds [gate_r; up_r]
                halves = [part.chunk(2, dim=0) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
                grad = torch.cat(parts, dim=0)
            else:
                grad = torch.cat(parts, dim=p.partition_dim)
        out[name] = grad
    return out


def _logits_and_grads(variant, tp_size, sequence_parallel=False, overrides=None):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megaloop.config import ParallelConfig
    from megaloop.models.model import build_model
    from megaloop.platform.distributed import init_distributed

    cfg = small_config(variant, **(overrides or {}))
    init_distributed(tensor_parallel=tp_size, seed=11)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    model = build_model(cfg, ParallelConfig(tensor=tp_size, sequence_parallel=sequence_parallel))
    # The training path: DDP grad buffers, then finalize_model_grads (which also sums the QK-norm
    # gradients, and under sequence parallelism every norm's, over tensor-parallel ranks).
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    logits = gather_from_tensor_model_parallel_region(model(x))
    model(x, labels=labels).mean().backward()
    finalize_model_grads([model])
    return logits.detach(), _full_gradients(model, tp_size)


def _compare_tp(rank, world_size, variant, sequence_parallel, overrides=None):
    logits1, grads1 = _logits_and_grads(variant, 1, overrides=overrides)
    logits2, grads2 = _logits_and_grads(variant, 2, sequence_parallel, overrides)
    torch.testing.assert_close(logits2, logits1, atol=1e-5, rtol=1e-5)
    assert grads1.keys() == grads2.keys()
    for name in grads1:
        torch.testing.assert_close(grads2[name], grads1[name], atol=1e-5, rtol=1e-4, msg=name)
    return True


@pytest.mark.parametrize("variant", ["dense", "fullloop_olmo", "asymloop", "asymloop_no_local_kv"])
def test_tp2_matches_tp1(variant):
    assert run_distributed(_compare_tp, world_size=2, variant=variant,
                           sequence_parallel=False) == [True, True]


def test_tp2_matches_tp1_for_latentloop_visits_narrowed_to_half_width():
    """The width-reduced visit computes with the leading d/2 of each shared matrix: d is never split
    over tensor-parallel ranks, so every rank narrows its own shard alike (and its projections are
    replicated); visits 1 and 2 narrowed, visit 3 full."""
    assert run_distributed(_compare_tp, world_size=2, variant="latentloop", sequence_parallel=False,
                           overrides=dict(iterations=3, latent_reduction="width",
                                          latent_visits=[1, 2])) == [True, True]


# Every norm placement (pre-norm, OLMo's post-norm, Global KV norm, QK-norm), Global KV and both
# decoder attentions, additive injection.
@pytest.mark.parametrize("variant", ["dense", "fullloop_olmo", "asymloop", "asymloop_no_local_kv",
                                     "asymloop_additive"])
def test_tp2_with_sequence_parallel_matches_tp1(variant):
    assert run_distributed(_compare_tp, world_size=2, variant=variant,
                           sequence_parallel=True) == [True, True]
