"""Selective activation recomputation (parallel.recompute=selective, megatron-core's
--recompute-granularity selective --recompute-modules ...): the same losses and gradients as
without it, bit for bit, in every architecture; less memory held for the backward pass; each
replay of a weight-tied layer with its own iteration's inputs; refusals of what would not apply."""

import pytest
import torch

from megaloop.config import ConfigError, ParallelConfig, RunConfig, apply_overrides
from megaloop.models.model import build_model
from tests.models.variants import ALL_VARIANTS, small_config


def _tokens(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)


def _twins(cfg, modules=()):
    """A model without recomputation and one with selective recomputation of ``modules``
    (megatron-core's default, core_attn, when empty), with equal weights."""
    plain = build_model(cfg)
    selective = build_model(cfg, ParallelConfig(recompute="selective",
                                                recompute_modules=list(modules)))
    selective.load_state_dict(plain.state_dict())
    return plain, selective


def _loss_and_grads(model, cfg):
    loss = model(_tokens(cfg, 0), labels=_tokens(cfg, 1)).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_identical(cfg, modules=()):
    plain, selective = _twins(cfg, modules)
    loss_a, grads_a = _loss_and_grads(plain, cfg)
    loss_b, grads_b = _loss_and_grads(selective, cfg)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert grad is not None and torch.equal(grad, grads_b[name]), name


@pytest.mark.parametrize("variant", list(ALL_VARIANTS))
def test_selective_recompute_of_core_attention_changes_no_loss_or_gradient_bit(seeded, variant):
    """Every architecture and ablation: encoder, joint (fused and masked) and Global-only decoder
    attention, LatentLoop's visits and coda, MoE layers."""
    _assert_identical(small_config(variant))


@pytest.mark.parametrize("variant, modules", [
    ("asymloop", ["core_attn", "mlp"]),
    ("asymloop_olmo", ["mlp"]),
    ("asymloop_moe_decoder", ["core_attn", "mlp", "moe"]),
    ("dense_moe_shared", ["shared_experts"]),
    ("latentloop_moe_width", ["moe", "core_attn"]),
])
def test_selective_recompute_of_other_modules_changes_no_loss_or_gradient_bit(seeded, variant,
                                                                               modules):
    _assert_identical(small_config(variant), modules)


def _saved_bytes(model, cfg) -> int:
    """Bytes of the distinct tensors the forward pass saves for the backward pass."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(_tokens(cfg, 0), labels=_tokens(cfg, 1)).mean()
    return sum(storages.values())


def _saved_inside_core_attention(model, cfg) -> int:
    """Tensors the forward pass saves for the backward pass while a core attention runs."""
    inside, saved = [0], [0]

    def enter(module, args):
        inside[0] += 1

    def leave(module, args, output):
        inside[0] -= 1

    def pack(tensor):
        saved[0] += inside[0] > 0
        return tensor

    for name, module in model.named_modules():
        if name.endswith("core_attention"):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(_tokens(cfg, 0), labels=_tokens(cfg, 1)).mean()
    return saved[0]


@pytest.mark.parametrize("variant", ["dense", "asymloop", "asymloop_masked",
                                     "asymloop_no_local_kv", "latentloop", "asymloop_moe"])
def test_the_core_attention_keeps_nothing_for_the_backward_pass(seeded, variant):
    """Every attention role (plain, joint fused and masked, Global-only, LatentLoop's visits):
    without recomputation its kernel saves tensors; with it, the forward runs without grad and
    the backward pass replays it from its inputs."""
    cfg = small_config(variant)
    plain, selective = _twins(cfg)
    assert _saved_inside_core_attention(plain, cfg) > 0
    assert _saved_inside_core_attention(selective, cfg) == 0


def test_selective_recompute_drops_the_attention_probabilities(seeded):
    """The masked joint attention materialises [N, 2N] probabilities per head in every decoder
    call (K x D calls); selective recomputation keeps none of them for the backward pass."""
    cfg = small_config("asymloop_masked").resolve()
    plain, selective = _twins(cfg)
    batch, n = 2, cfg.seq_length
    probabilities = batch * cfg.num_attention_heads * n * 2 * n * 4  # fp32 bytes, one call
    calls = cfg.iterations * cfg.num_decoder_layers
    assert _saved_bytes(plain, cfg) - _saved_bytes(selective, cfg) >= calls * probabilities


def test_each_iteration_replays_its_own_inputs(seeded):
    """K=3: the backward pass replays the core attention of every call of every tied decoder
    layer once (K per layer), each from the inputs that call saved: the Global KV and the
    iteration's own queries, keys and values. Replayed with another iteration's inputs, the
    gradients would differ from those without recomputation."""
    cfg = small_config("asymloop", iterations=3).resolve()
    plain, selective = _twins(cfg)
    replays = {}

    def count(module, args, output):
        if torch.is_grad_enabled():
            replays[module] = replays.get(module, 0) + 1

    for layer in selective.decoder.layers:
        layer.self_attention.core_attention.register_forward_hook(count)
    loss = selective(_tokens(cfg, 0), labels=_tokens(cfg, 1)).mean()
    assert not replays  # the checkpointed forward runs without grad
    loss.backward()
    assert sorted(replays.values()) == [cfg.iterations] * cfg.num_decoder_layers
    loss_a, grads_a = _loss_and_grads(plain, cfg)
    for name, param in selective.named_parameters():
        assert torch.equal(param.grad, grads_a[name]), name
    global_kv = [n for n in grads_a if "linear_kv_global" in n]
    assert global_kv and all(grads_a[n].abs().sum() > 0 for n in global_kv)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("overrides, message", [
    (["parallel.recompute_modules=[core_attn]"],
     "parallel.recompute_modules=['core_attn']: must be empty unless parallel.recompute=selective"),
    (["parallel.recompute=full", "parallel.recompute_modules=[mlp]"],
     "parallel.recompute_modules=['mlp']: must be empty unless parallel.recompute=selective"),
    (["parallel.recompute=selective", "parallel.recompute_modules=[mla_up_proj]"],
     "parallel.recompute_modules=['mla_up_proj']: must be names from core_attn, layernorm, mlp, "
     "moe, moe_act, shared_experts ('mla_up_proj' is not one)"),
    (["parallel.recompute=selective", "parallel.recompute_modules=[core_attn,moe_act]"],
     "parallel.recompute_modules=['core_attn', 'moe_act']: must be modules the model has "
     "('moe_act': no MoE layer without model.num_experts > 0)"),
    (["parallel.recompute=selective", "parallel.recompute_modules=[moe]"], "'moe': no MoE layer"),
    (["parallel.recompute=selective", "parallel.recompute_modules=[shared_experts]",
      "model.num_experts=4"], "'shared_experts': no shared expert"),
    (["parallel.recompute=selective", "parallel.recompute_modules=[mlp]", "model.num_experts=4"],
     "'mlp': every FFN is a MoE layer"),
    (["parallel.recompute=selective", "parallel.recompute_modules=[layernorm]",
      "model.block=olmo"], "'layernorm': model.block=olmo has no pre-norms"),
    (["parallel.recompute=selective", "parallel.recompute_modules=[mlp,mlp]"], "each module once"),
])
def test_recompute_modules_that_would_do_nothing_are_refused(overrides, message):
    cfg = apply_overrides(RunConfig(), ["data.path=[/d]", "data.eod_id=0", *overrides])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_accepted_recompute_modules_validate():
    for overrides in (["parallel.recompute=selective"],
                      ["parallel.recompute=selective", "parallel.recompute_modules=[mlp]",
                       "model.num_experts=4", "model.moe_layers=decoder"],
                      ["parallel.recompute=selective",
                       "parallel.recompute_modules=[layernorm,moe,shared_experts]",
                       "model.num_experts=4", "model.moe_shared_expert_size=8"]):
        apply_overrides(RunConfig(), ["data.path=[/d]", "data.eod_id=0", *overrides]).validate()


FP8 = ["data.path=[/d]", "data.eod_id=0", "train.precision=fp8", "parallel.recompute=selective"]


@pytest.mark.parametrize("overrides, refused", [
    # Core attention holds no FP8 state: safe with every recipe, looped or not.
    (["train.fp8_recipe=delayed", "model.arch=asymloop", "model.iterations=3"], None),
    (["train.fp8_recipe=delayed", "model.arch=fullloop", "model.iterations=2",
      "parallel.recompute_modules=[core_attn]"], None),
    # FP8 linears replayed by Transformer Engine's checkpoint: the tied block's FIFO problem.
    (["train.fp8_recipe=delayed", "model.arch=asymloop", "model.iterations=3",
      "parallel.recompute_modules=[core_attn,mlp]"], "with parallel.recompute_modules=['mlp'] "
     "and a looped model (delayed scaling would recompute iteration K with iteration 1's scales)"),
    (["train.fp8_recipe=delayed", "model.arch=dense", "model.iterations=1",
      "parallel.recompute_modules=[mlp]"], None),
    # megatron-core's own refusal, for any model, said before the model is built.
    (["train.fp8_recipe=delayed", "model.arch=dense", "model.iterations=1",
      "parallel.recompute_modules=[layernorm]"],
     "with parallel.recompute_modules=['layernorm'] (megatron-core supports no delayed scaling"),
    (["train.fp8_recipe=current", "model.arch=asymloop", "model.iterations=3",
      "parallel.recompute_modules=[mlp,layernorm]"], None),
])
def test_delayed_fp8_refuses_exactly_the_selective_modules_it_cannot_replay(overrides, refused):
    cfg = apply_overrides(RunConfig(), FP8 + overrides)
    if refused is None:
        cfg.validate()
        return
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith("train.fp8_recipe='delayed': must be 'current' or 'mxfp8' ")
    assert refused in str(err.value)


@pytest.mark.parametrize("module", ["moe_act", "layernorm"])
def test_modules_megatron_core_replays_only_with_transformer_engine_are_refused_without(seeded,
                                                                                        module):
    """moe_act: only grouped-GEMM experts; layernorm: megatron-core 0.16.1's
    CheckpointWithoutOutput reads Transformer Engine's FP8 state whatever the precision."""
    cfg = small_config("asymloop_moe")
    with pytest.raises(ConfigError, match=f"'{module}' needs the Transformer Engine spec"):
        build_model(cfg, ParallelConfig(recompute="selective", recompute_modules=[module]),
                    use_te=False)


@pytest.mark.parametrize("variant", ["dense", "asymloop"])
def test_layernorm_recomputation_of_a_model_without_moe_layers_is_refused(seeded, variant):
    """With Transformer Engine (which the norm replay needs) every pre-norm of a dense layer is
    fused into the linear after it: megatron-core finds no norm module to replay and skips it
    silently, so the setting would change nothing."""
    with pytest.raises(ConfigError, match="'layernorm' replays nothing in a model without MoE "
                                          "layers") as err:
        build_model(small_config(variant),
                    ParallelConfig(recompute="selective", recompute_modules=["layernorm"]),
                    use_te=True)
    assert "\n" not in str(err.value)


def test_a_resume_applies_a_changed_recomputation_and_says_so(tmp_path, caplog):
    """Recomputation changes no weight, optimizer state or sample: a resume may switch it (here
    none -> selective of core_attn and mlp), each changed field one warning line."""
    import dataclasses
    import logging

    from tests.training.test_resume import _check, _checkpoint

    path, cfg = _checkpoint(tmp_path, data={"eod_id": 0})
    changed = dataclasses.replace(cfg, parallel=ParallelConfig(
        recompute="selective", recompute_modules=["core_attn", "mlp"]))
    assert _check(path, changed, caplog) == [
        (logging.WARNING, f"resume from {path}: parallel.recompute changed from 'none' to "
                          "'selective'; in effect from step 5"),
        (logging.WARNING, f"resume from {path}: parallel.recompute_modules changed from [] to "
                          "['core_attn', 'mlp']; in effect from step 5")]


@pytest.mark.parametrize("variant, noted", [("asymloop", True), ("dense", True),
                                            ("asymloop_masked", False)])
def test_recomputing_flash_attention_is_noted_as_saving_little(seeded, caplog, variant, noted):
    import logging

    with caplog.at_level(logging.WARNING, logger="megaloop.models"):
        build_model(small_config(variant), ParallelConfig(recompute="selective"))
    lines = [r.getMessage() for r in caplog.records if "'core_attn' replays" in r.getMessage()]
    assert len(lines) == (1 if noted else 0)
