"""MoE layers (megatron-core MoELayer) in looped models: weight sharing across iterations, auxiliary
losses counted once per application, per-iteration routing statistics, model-wide layer numbers."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

from megaloop.config import ConfigError, ModelConfig, ParallelConfig
from megaloop.models import moe
from megaloop.models.model import build_model
from tests.models.variants import small_config


def _tokens(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)


def test_every_physical_layer_has_its_own_model_wide_number(seeded):
    model = build_model(small_config("asymloop_moe", num_layers=5, encoder_layers=2))
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    numbers = [layer.global_layer_number for layer in layers]
    assert numbers == [1, 2, 3, 4, 5]
    # The block-local number (checkpoint stacking, Global KV slice) still counts from 1 per block.
    assert [layer.layer_number for layer in model.decoder.layers] == [1, 2, 3]
    for layer in layers:  # the inference KV-cache key and the router's statistics use it
        assert layer.self_attention.layer_number == layer.global_layer_number
        assert layer.mlp.router.global_layer_number == layer.global_layer_number


def _unrolled_copy(looped):
    """A Dense model with the R x L layers of a Full Loop unrolled, each a copy of its tied layer."""
    cfg = looped.cfg
    dense = build_model(dataclasses.replace(cfg, arch="dense", iterations=1,
                                            num_layers=cfg.iterations * cfg.num_layers))
    state = looped.state_dict()
    dense.load_state_dict({name: state[_tied_name(name, cfg.num_layers)]
                           for name in dense.state_dict()})
    return dense


def _tied_name(name: str, num_layers: int) -> str:
    """The Full Loop parameter that unrolled layer ``name`` copies."""
    if not name.startswith("decoder.layers."):
        return name
    index, rest = name[len("decoder.layers."):].split(".", 1)
    return f"decoder.layers.{int(index) % num_layers}.{rest}"


@pytest.mark.parametrize("recompute", [False, True])
def test_shared_moe_gradients_equal_the_sum_over_an_unrolled_copy(seeded, recompute):
    """A MoE layer applied R times gets every application's gradient, auxiliary losses included,
    each counted once (the coefficients are large so that a 1/R rescaling could not hide)."""
    cfg = small_config("fullloop_moe", num_layers=2, iterations=3, moe_aux_loss_coeff=0.5,
                       moe_z_loss_coeff=0.2)
    looped = build_model(cfg, ParallelConfig(recompute="full" if recompute else "none")).train()
    dense = _unrolled_copy(looped).train()
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    for model in (looped, dense):
        model(x, labels=labels).mean().backward()
    unrolled = {}
    for name, p in dense.named_parameters():
        name = _tied_name(name, cfg.num_layers)
        unrolled[name] = unrolled.get(name, 0) + p.grad
    for name, p in looped.named_parameters():
        torch.testing.assert_close(p.grad, unrolled[name], atol=1e-5, rtol=1e-4, msg=name)
    # The auxiliary losses do reach the router: without them its gradient differs.
    plain = build_model(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0))
    plain.load_state_dict(looped.state_dict())
    plain.train()(x, labels=labels).mean().backward()
    router = "decoder.layers.0.mlp.router.weight"
    assert (dict(plain.named_parameters())[router].grad
            - dict(looped.named_parameters())[router].grad).abs().max() > 1e-3


def _reference_statistics(logits: torch.Tensor, top_k: int):
    """Switch load-balancing loss E / (k T^2) sum_i (sum_t p_ti) n_i, z-loss mean(logsumexp^2) and
    tokens per expert, written out independently of megatron-core."""
    tokens, experts = logits.shape
    probs = logits.softmax(-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=1).indices, 1.0)
    counts = chosen.sum(0)
    load = experts / (top_k * tokens * tokens) * (probs.sum(0) * counts).sum()
    return load.item(), logits.logsumexp(-1).pow(2).mean().item(), counts


@pytest.mark.parametrize("recompute, modules", [("none", []), ("full", []), ("selective", ["moe"])])
def test_routing_statistics_are_reported_per_iteration(seeded, recompute, modules):
    """Each application once: a replay in the backward pass (full recomputation, or selective of
    the MoE layer) is not recorded."""
    cfg = small_config("asymloop_moe", iterations=2)
    parallel = ParallelConfig(recompute=recompute, recompute_modules=modules)
    model = build_model(cfg, parallel).train()
    replays = recompute != "none"  # then the forward's own call runs without autograd
    logits_per_call = {}  # router -> the logits of each application, in order
    for router in moe.routers(model):
        router.register_forward_hook(
            lambda m, args, out, r=router: logits_per_call.setdefault(r, []).append(
                r.gating(args[0]).detach().view(-1, cfg.num_experts)) if torch.is_grad_enabled()
            != replays else None)
    model(_tokens(cfg), labels=_tokens(cfg, seed=1)).mean().backward()
    report = model.routing_stats.report()
    groups = {"encoder": [(r, 0) for r in moe.routers(model.encoder)],
              "iter1": [(r, 0) for r in moe.routers(model.decoder)],
              "iter2": [(r, 1) for r in moe.routers(model.decoder)]}
    for group, calls in groups.items():
        stats = [_reference_statistics(logits_per_call[r][i], cfg.moe_top_k) for r, i in calls]
        assert report[f"moe_lb_loss_{group}"] == pytest.approx(
            sum(s[0] for s in stats) / len(stats), rel=1e-5)
        assert report[f"moe_z_loss_{group}"] == pytest.approx(
            sum(s[1] for s in stats) / len(stats), rel=1e-5)
        tokens = sum(s[2] for s in stats) / len(stats)
        assert [report[f"moe_tokens_{group}_e{i}"] for i in range(cfg.num_experts)] == \
            pytest.approx(tokens.tolist())
        assert report[f"moe_max_load_{group}"] == pytest.approx((tokens.max() / tokens.mean()).item())
    assert model.routing_stats.report() == {}, "report starts the next step from zero"


def test_evaluation_records_no_routing_statistics_and_loss_is_pure_cross_entropy(seeded):
    cfg = small_config("fullloop_moe")
    model = build_model(cfg).train()
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    losses = model(x, labels=labels)  # the auxiliary losses reach the gradient only
    expected = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), labels.flatten(),
                                                 reduction="none").view_as(labels)
    torch.testing.assert_close(losses, expected, atol=1e-5, rtol=1e-5)
    model.routing_stats.report()
    model.eval()
    with torch.no_grad():
        model(x, labels=labels)
    assert model.routing_stats.report() == {}
    assert not get_moe_layer_wise_logging_tracker(), "megatron-core's per-layer tracker stays off"


def test_router_computes_in_fp32_under_bf16_weights(seeded):
    cfg = small_config("dense_moe_shared")
    model = build_model(cfg, params_dtype=torch.bfloat16)
    router = model.decoder.layers[0].mlp.router
    assert router.gating(torch.randn(4, 1, cfg.hidden_size, dtype=torch.bfloat16)).dtype \
        == torch.float32


def test_router_gating_runs_without_transformer_engine_or_the_cpu_intercepts():
    """megatron-core 0.16.1's router gating names ``te_general_gemm``, which it imports only with
    Transformer Engine. The fix used to live in the CPU intercepts, which a GPU never installs: on a
    GPU without Transformer Engine every MoE forward raised NameError (seen on an H200). A fresh
    process that imports megaloop's MoE module and installs no intercept must route."""
    code = ("import torch, megaloop.models.moe\n"
            "from megaloop.platform import cpu_compat\n"
            "from megatron.core.transformer.moe.moe_utils import router_gating_linear\n"
            "assert not cpu_compat.is_enabled()\n"
            "x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)\n"
            "print(router_gating_linear(x, w, None, torch.float32).shape)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "torch.Size([5, 3])"


def test_moe_layers_only_where_configured(seeded):
    model = build_model(small_config("asymloop_moe_decoder"))
    assert not moe.routers(model.encoder)
    assert len(moe.routers(model.decoder)) == model.cfg.num_decoder_layers
    assert model.routing_stats.groups == ["encoder", "iter1", "iter2"]


@pytest.mark.parametrize("fields, parallel, message", [
    (dict(num_experts=4, moe_top_k=5), {}, "model.moe_top_k=5: must be in [2, num_experts=4]"),
    (dict(num_experts=-1), {}, "model.num_experts=-1: must be 0 (dense FFN) or >= 2"),
    # Before: "model.moe_top_k=2: must be in [2, num_experts=1]", an empty range for a field the
    # user had not set.
    (dict(num_experts=1), {}, "model.num_experts=1: must be 0 (dense FFN) or >= 2"),
    (dict(num_experts=4, block="olmo"), {}, "model.block='olmo': must be 'llama' for a MoE"),
    (dict(num_experts=4, moe_layers="encoder", arch="fullloop", iterations=2), {},
     "model.moe_layers='encoder': must be 'all' unless arch=asymloop"),
    (dict(num_experts=6), dict(expert=4), "parallel.expert=4: must be a divisor of "
                                          "model.num_experts=6"),
    (dict(), dict(expert=2), "parallel.expert=2: must be 1 unless model.num_experts > 0"),
    (dict(num_experts=4), dict(tensor=2), "parallel.tensor=2: must be 1 for a MoE model unless "
                                          "parallel.sequence_parallel=true"),
])
def test_bad_moe_configurations_are_one_line_errors(fields, parallel, message):
    with pytest.raises(ConfigError) as err:
        cfg = ModelConfig(**fields)
        cfg.validate()
        ParallelConfig(**parallel).validate(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_active_parameters_are_what_one_token_touches(seeded):
    """One token's forward and backward reach exactly the analytical active parameters (router,
    its top-k experts, shared expert and the dense weights)."""
    from megaloop.models.flops import active_parameter_count, parameter_count

    cfg = small_config("dense_moe_shared", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    model = build_model(cfg)
    token = _tokens(cfg)[:1, :1]
    model(token, labels=token).sum().backward()
    touched = sum(p.numel() for p in model.parameters() if p.grad is not None and p.grad.any())
    assert touched == active_parameter_count(cfg) < parameter_count(cfg)


@pytest.mark.parametrize("name, fields", [
    # visit 2 has MoE layers of its own that route to moe_top_k // 2 = 2 of 8 experts
    ("latentloop_moe_topk", dict(untie_moe=True, latent_visits=[2])),
    # visit 1 alone runs the shared MoE layers, with half of each expert's hidden units
    ("latentloop_moe_expert_ffn", dict(untie_moe=True)),
])
def test_active_parameters_of_reduced_visits_are_what_one_token_touches(seeded, name, fields):
    """A LatentLoop MoE layer that only reduced visits run uses their fewer (top_k) or narrower
    (expert_ffn) experts. Before: counted at the full top-k and width (12288 and 15360 too many).
    An expert's weights count by element, so that the unused half of a narrowed one does not."""
    from megaloop.models.flops import active_parameter_count

    cfg = small_config(name, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0, **fields)
    model = build_model(cfg)
    token = _tokens(cfg)[:1, :1]
    model(token, labels=token).sum().backward()
    touched = sum(int(p.grad.count_nonzero()) if "experts" in n else p.numel()
                  for n, p in model.named_parameters() if p.grad is not None and p.grad.any())
    assert touched == active_parameter_count(cfg)


def _sft_batch(cfg, real: int, length: int) -> dict:
    """Two fine-tuning samples (megaloop.data.sft) of ``real`` positions padded to ``length``."""
    from megaloop.data.sft import sft_sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(2):
        ids = torch.randint(2, cfg.vocab_size, (real + 1,), generator=g).tolist()
        samples.append(sft_sample(ids[:3], ids[3:], length, pad_id=1))
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def _routing_of(model, *batches: dict) -> tuple[dict, dict]:
    """The routing statistics and the routers' gradients of one training step of these
    micro-batches, the auxiliary losses weighed as the trainer weighs them (per-token loss sums)."""
    for router in moe.routers(model):
        router.calculate_per_token_loss = True
    moe.weigh_auxiliary_losses([model], list(batches))
    model.zero_grad()
    for batch in batches:
        losses = model(batch["tokens"], labels=batch["labels"],
                       padding_mask=batch.get("padding_mask"))
        (losses * batch["loss_mask"]).sum().backward()
    return model.routing_stats.report(), {n: p.grad.clone() for n, p in model.named_parameters()
                                          if "router" in n}


@pytest.mark.parametrize("name, fields", [
    ("asymloop_moe", {}), ("latentloop_moe", {}), ("latentloop_moe", dict(latent_stride=4)),
    ("latentloop_moe", dict(latent_stride=4, latent_visits=[1, 2]))])
@pytest.mark.parametrize("recompute", [False, True])
def test_training_weighs_every_application_s_auxiliary_losses_with_its_coefficient(
        seeded, name, fields, recompute):
    """The trainer's per-token loss sums (divided by the tokens afterwards) give the routers the
    gradient of the mean loss plus every application's auxiliary losses times their
    coefficients. Before, a LatentLoop compressed visit, which routes 1/k of the positions (its
    latents), weighed its losses by its own token count: 1/k of their coefficients in training
    (the middle block's router gradients from the z-loss: 0.75x, stride 4: 0.57x)."""
    cfg = small_config(name, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.2, **fields)
    model = build_model(cfg, ParallelConfig(recompute="full" if recompute else "none")).train()
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    _, per_token = _routing_of(model, {"tokens": x, "labels": labels,
                                       "loss_mask": torch.ones(x.shape)})
    for router in moe.routers(model):
        router.calculate_per_token_loss = False
    model.zero_grad()
    model(x, labels=labels).mean().backward()
    for key, p in model.named_parameters():
        if "router" in key:
            torch.testing.assert_close(per_token[key] / x.numel(), p.grad, rtol=1e-4,
                                       atol=1e-7, msg=key)


@pytest.mark.parametrize("name, recompute", [
    ("dense_moe_shared", False), ("fullloop_moe", False), ("asymloop_moe", False),
    ("asymloop_moe", True), ("latentloop_moe", False), ("latentloop_moe", True),
    ("latentloop_moe_untied_v3", False), ("latentloop_moe_width", False)])
def test_padding_has_no_effect_on_routing(seeded, name, recompute):
    """A fine-tuning batch padded from 11 to 16 positions routes as the same batch without its
    padding: the same auxiliary losses (the routers' gradients), routing statistics and expert
    token counts. 11 is odd: LatentLoop's compressed visit pools positions 10 (real) and 11
    (padding) into a latent that the unpadded batch does not have."""
    cfg = small_config(name, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.2)
    model = build_model(cfg, ParallelConfig(recompute="full" if recompute else "none")).train()
    padded = _sft_batch(cfg, 11, cfg.seq_length)
    assert padded["padding_mask"][:, 11:].all() and not padded["padding_mask"][:, :11].any()
    plain = {key: value[:, :11] for key, value in padded.items() if key != "padding_mask"}
    stats, grads = _routing_of(model, padded)
    expected, expected_grads = _routing_of(model, plain)
    assert stats.keys() == expected.keys()
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for key, grad in expected_grads.items():
        # Rounding, not padding: the two batches run fp32 GEMMs of different row counts (22
        # and 32 tokens), which may sum in another order (with more threads, split otherwise).
        # An entry that cancels to ~1e-4 keeps the absolute error of the largest terms: up to
        # 9.5e-7 (1 ulp) in entries up to 8.7 in latentloop_moe_width with OMP_NUM_THREADS=2,
        # where atol=1e-7 failed. In float64 the two gradients are equal; without the mask they
        # differ by their own size.
        atol = 4 * torch.finfo(grad.dtype).eps * grad.abs().max().item()
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=atol, msg=key)
    # Without the mask the padding is routed: the statistics say so.
    unmasked, _ = _routing_of(model, {k: v for k, v in padded.items() if k != "padding_mask"})
    assert any(unmasked[key] != pytest.approx(value, rel=1e-3) for key, value in expected.items())


def test_padding_reaches_no_expert(seeded):
    """Padding positions are dispatched to no expert: megatron-core would leave them out of the
    auxiliary losses only."""
    cfg = small_config("dense_moe_shared")
    model = build_model(cfg).train()
    batch = _sft_batch(cfg, 5, cfg.seq_length)
    dispatched = []
    for router in moe.routers(model):
        router.register_forward_hook(lambda m, args, out: dispatched.append(out[1]))
    model(batch["tokens"], padding_mask=batch["padding_mask"])
    for routing_map in dispatched:  # [N * B, experts], sequence-major
        per_position = routing_map.view(cfg.seq_length, 2, -1).sum(-1).t()
        assert per_position[:, :5].eq(cfg.moe_top_k).all() and per_position[:, 5:].eq(0).all()


def test_padding_mask_of_another_shape_is_refused(seeded):
    cfg = small_config("fullloop_moe")
    with pytest.raises(ValueError, match=r"padding_mask of shape \[2, 15\]: must have the shape "
                                         r"of input_ids, \[2, 16\]"):
        build_model(cfg)(_tokens(cfg), padding_mask=torch.zeros(2, 15, dtype=torch.bool))


def test_finetuning_trainer_keeps_padding_out_of_routing(mcore, tmp_path):
    """Through the trainer (data.format=sft): other token ids in the padding change neither the
    routers' gradients (auxiliary losses included) nor the routing statistics."""
    from megaloop.config import DataConfig, RunConfig, TrainConfig
    from megaloop.training.data import MicroBatches
    from megaloop.training.trainer import Trainer
    from tests.sft import PROMPT, SOLUTION, arithmetic_records, train_tokenizer, write_jsonl

    records = arithmetic_records(8)
    cfg = RunConfig(
        model=small_config("asymloop_moe", vocab_size=512, seq_length=64, moe_z_loss_coeff=0.1),
        train=TrainConfig(micro_batch_size=2, global_batch_size=2, train_steps=1,
                          out_dir=str(tmp_path), log_interval=100, tensorboard=False),
        data=DataConfig(path=[str(write_jsonl(tmp_path / "train.jsonl", records))], format="sft",
                        tokenizer_model=str(train_tokenizer(tmp_path / "tok.model", records)),
                        split="1,0,0", sft_prompt=PROMPT, sft_solution=SOLUTION))
    with Trainer(cfg) as trainer:
        batch = next(MicroBatches(trainer.train_data, 2, 0, 1, 0, 2))
        padding = batch["padding_mask"]
        assert padding.any() and not padding[:, 0].any()
        changed = {**batch, "tokens": torch.where(padding, (batch["tokens"] + 7) % 400,
                                                  batch["tokens"])}
        results = []
        for step in (batch, changed):
            trainer.ddp.zero_grad_buffer()
            trainer._run_microbatches(iter([step]), forward_only=False)
            results.append((trainer.model.routing_stats.report(),
                            {n: p.main_grad.clone() for n, p in
                             trainer.model.named_parameters() if "router" in n}))
    (stats, grads), (same_stats, same_grads) = results
    assert stats == pytest.approx(same_stats, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(same_grads[name], grad, rtol=1e-5, atol=1e-8, msg=name)


def _padded_routing_at(tp: int) -> tuple[dict, dict]:
    """Statistics and (TP=1-layout) router gradients of a padded batch at tensor parallelism
    ``tp`` with sequence parallelism (padding falls on the last rank's share only)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megaloop.platform.distributed import init_distributed

    init_distributed(tensor_parallel=tp, seed=11)
    cfg = small_config("fullloop_moe", moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.2)
    model = build_model(cfg, ParallelConfig(tensor=tp, sequence_parallel=tp > 1)).train()
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    batch = _sft_batch(cfg, 11, cfg.seq_length)
    for router in moe.routers(model):
        router.calculate_per_token_loss = True
    moe.weigh_auxiliary_losses([model], [batch])
    losses = model(batch["tokens"], labels=batch["labels"], padding_mask=batch["padding_mask"])
    (losses * batch["loss_mask"]).sum().backward()
    finalize_model_grads([model])
    stats = model.module.routing_stats.report()
    return stats, {n: p.main_grad.clone() for n, p in model.module.named_parameters()
                   if "router" in n}


def _compare_padded_routing(rank, world_size):
    (stats1, grads1), (stats2, grads2) = _padded_routing_at(1), _padded_routing_at(2)
    assert stats2 == pytest.approx(stats1, rel=1e-5, abs=1e-7)
    for name, grad in grads1.items():
        torch.testing.assert_close(grads2[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    return True


def test_padding_under_sequence_parallelism_routes_as_on_one_rank():
    """TP=2 with sequence parallelism: the padding mask is split with the sequence, and the
    ranks' unequal shares of valid tokens weigh the auxiliary losses and statistics as one rank
    holding them all."""
    from tests.distributed import run_distributed

    assert run_distributed(_compare_padded_routing, world_size=2) == [True, True]


def test_a_compressed_visit_of_padding_only_adds_no_loss(seeded):
    """Records shorter than latent_stride: every latent of the compressed visit holds padding.
    The step's gradients are finite and the routers' those of the unpadded batch (whose visit
    has no latent at all); megatron-core's load-balancing loss divided 0 by 0 valid tokens."""
    cfg = small_config("latentloop_moe", latent_stride=4, moe_aux_loss_coeff=0.5,
                       moe_z_loss_coeff=0.2)
    model = build_model(cfg).train()
    padded = _sft_batch(cfg, 3, cfg.seq_length)
    plain = {key: value[:, :3] for key, value in padded.items() if key != "padding_mask"}
    stats, grads = _routing_of(model, padded)
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    expected_stats, expected = _routing_of(model, plain)
    assert not any("visit1" in key for key in {**stats, **expected_stats}), \
        "a visit of padding only routes nothing: no statistics, as without the padding"
    for key, grad in expected.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-7, msg=key)


def _unpadded(batch: dict, real: int) -> dict:
    return {key: value[:, :real] for key, value in batch.items() if key != "padding_mask"}


def test_routing_statistics_weigh_applications_by_their_valid_tokens(seeded):
    """A step of a long and a heavily padded micro-batch (the compressed visit of the short one
    holds padding only) reports what the same step without padding reports: each application
    weighs by its valid tokens, one of padding only not at all (it halved the visit's losses)."""
    cfg = small_config("latentloop_moe", latent_stride=4, moe_aux_loss_coeff=0.5,
                       moe_z_loss_coeff=0.2)
    model = build_model(cfg).train()
    long, short = _sft_batch(cfg, 12, cfg.seq_length), _sft_batch(cfg, 3, cfg.seq_length)
    stats, _ = _routing_of(model, long, short)
    expected, _ = _routing_of(model, _unpadded(long, 12), _unpadded(short, 3))
    assert stats.keys() == expected.keys() and "moe_lb_loss_visit1" in stats
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # Independently: the valid-token mean of the micro-batches' own statistics (12 : 3 positions).
    alone = [_routing_of(model, _unpadded(batch, real))[0] for batch, real in ((long, 12),
                                                                              (short, 3))]
    for key in ("moe_lb_loss_prelude", "moe_z_loss_coda"):
        assert stats[key] == pytest.approx((12 * alone[0][key] + 3 * alone[1][key]) / 15,
                                           rel=1e-6), key
    for key in ("moe_lb_loss_visit1", "moe_z_loss_visit1"):
        assert stats[key] == pytest.approx(alone[0][key], rel=1e-6), key
