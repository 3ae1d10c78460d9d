"""GPU checks (marker ``gpu``; skipped without CUDA), run by tools/gpu_check.sh: what reading the
code against torch, megatron-core and Transformer Engine cannot settle.

Every check asserts a property against an independent reference: the fused joint attention and the
whole model against float64 masked references (a bf16 result may be at most a few times as far
from float64 as the same reference computed in bf16), causality, host synchronisations that do not
grow with depth, FP8 recomputation that replays the first pass (full, and selective of the core
attention with delayed scaling), the Global K/V projection in FP8, FP8 scales that cover every
iteration, and checkpoints that move between the local and Transformer Engine specs. Measured
numbers go to the file $MEGALOOP_GPU_RECORD names (one JSON object per line), for the check's
report.
"""

import json
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megaloop.config import ParallelConfig
from megaloop.models.export import reference_state_dict, to_reference, to_reference_state_dict
from megaloop.models.model import build_model
from tests.models.test_joint_attention import (joint_core_attention, layout_errors,
                                               megatron_layout_leaves, relative_error)
from tests.models.variants import VARIANTS, assert_causal, small_config

pytestmark = pytest.mark.gpu

ROLE_VARIANTS = ["dense", "dense_olmo", "asymloop", "asymloop_olmo", "asymloop_no_local_kv"]
E4M3_MAX = 448.0


def record(check: str, **values) -> None:
    """Appends measured numbers to the GPU check's record, when it asks for one."""
    path = os.environ.get("MEGALOOP_GPU_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": check, **values}) + "\n")


def _tokens(cfg, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g).cuda()


def _transformer_engine():
    pytest.importorskip("transformer_engine")
    return True


def _fp8(recipe: str):
    _transformer_engine()
    from megaloop.config import ConfigError
    from megaloop.platform.fp8 import check_fp8_support

    try:
        check_fp8_support(recipe)
    except ConfigError as e:
        pytest.skip(str(e))


# ------------------------------------------------------------------------------------------------
# fused joint attention on megatron-core's layouts
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [130, 257, 1024])
def test_fused_joint_attention_on_megatron_layouts_matches_fp64(n, d, heads, groups):
    errors = layout_errors(2, n, heads, groups, d, torch.bfloat16, "cuda")
    record("joint_attention_bf16_vs_fp64", n=n, d=d, heads=heads, groups=groups, **errors)
    # bf16 rounding alone is ~2e-3 (values); a wrong merge or a missing gradient term is O(1).
    assert errors["out"] < 1e-2 and errors["d_qkv"] < 2e-2 and errors["d_global_kv"] < 2e-2, errors


@pytest.mark.parametrize("n", [130, 1024])
def test_fused_joint_attention_is_causal_in_bf16(n):
    heads, groups, d, t = 8, 2, 64, n // 2
    mixed, global_kv = megatron_layout_leaves(1, n, heads, groups, d, torch.bfloat16, "cuda")
    with torch.no_grad():
        base = joint_core_attention(mixed, global_kv, heads, d)
        local_kv = mixed.clone()
        local_kv[t, :, :, heads // groups * d:] += 1.0  # Local keys and values at position t
        global_kv_t = global_kv.clone()
        global_kv_t[t] += 1.0  # Global keys and values at position t
        for perturbed in ((local_kv, global_kv), (mixed, global_kv_t)):
            out = joint_core_attention(*perturbed, heads, d)
            torch.testing.assert_close(out[:t], base[:t], atol=0, rtol=0)
            assert (out[t:] - base[t:]).abs().max() > 0


# ------------------------------------------------------------------------------------------------
# the whole model against the reference
# ------------------------------------------------------------------------------------------------

def model_vs_reference(model, cfg):
    """Relative errors against the float64 reference, of ``model`` and of the same reference in
    ``model``'s dtype (the yardstick): logits and each parameter's gradient (reference names)."""
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    dtype = next(model.parameters()).dtype
    references = {"fp64": to_reference(model).double().cuda(),
                  "same_dtype": to_reference(model).to(dtype).cuda()}
    logits = model(x)
    model(x, labels=labels).float().mean().backward()
    grads = reference_state_dict({n: p.grad for n, p in model.named_parameters()}, cfg)
    ref_logits, ref_grads = {}, {}
    for name, reference in references.items():
        out = reference(x).logits
        F.cross_entropy(out.flatten(0, 1).double(), labels.flatten()).backward()
        ref_logits[name] = out
        ref_grads[name] = {n: p.grad for n, p in reference.named_parameters()}
    exact = ref_logits["fp64"]
    errors = {"logits": (relative_error(logits, exact),
                         relative_error(ref_logits["same_dtype"], exact))}
    for name, grad in ref_grads["fp64"].items():
        errors[name] = (relative_error(grads[name], grad),
                        relative_error(ref_grads["same_dtype"][name], grad))
    return errors


def assert_parity(errors, floor):
    worst = {name: pair for name, pair in errors.items() if pair[0] > max(3 * pair[1], floor)}
    assert not worst, f"(megaloop, yardstick) relative errors against float64: {worst}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_local_spec_bf16_matches_reference(seeded, variant):
    cfg = small_config(variant, hidden_size=128, seq_length=128)
    model = build_model(cfg, use_te=False, params_dtype=torch.bfloat16).cuda()
    errors = model_vs_reference(model, cfg)
    record("local_spec_bf16_vs_fp64", variant=variant,
           worst=max(errors.items(), key=lambda kv: kv[1][0]))
    assert_parity(errors, floor=2e-2)


@pytest.mark.parametrize("variant", ["asymloop", "asymloop_no_local_kv", "asymloop_tied_gqa1"])
def test_local_spec_fp32_on_cuda_matches_reference_through_the_masked_path(seeded, variant):
    cfg = small_config(variant, hidden_size=128, seq_length=128)
    model = build_model(cfg, use_te=False).cuda()
    errors = model_vs_reference(model, cfg)
    worst = max(pair[0] for pair in errors.values())
    record("local_spec_fp32_vs_fp64", variant=variant, worst=worst)
    assert worst < 1e-4, errors


# ------------------------------------------------------------------------------------------------
# host synchronisations
# ------------------------------------------------------------------------------------------------

def count_host_syncs(fn) -> int:
    """Synchronising CUDA calls ``fn`` makes, as torch's sync debug mode reports them."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_host_syncs_per_step_do_not_grow_with_depth(seeded, recompute):
    assert count_host_syncs(lambda: torch.tensor([1], device="cuda")) >= 1, "detector is off"
    counts = {}
    for k in (1, 4):
        cfg = small_config("asymloop", iterations=k, hidden_size=128, seq_length=128)
        model = build_model(cfg, ParallelConfig(recompute=recompute), use_te=False,
                            params_dtype=torch.bfloat16).cuda()
        x = _tokens(cfg)
        model(x, labels=x).float().mean().backward()  # warm-up: lazy initialisation syncs
        counts[k] = count_host_syncs(lambda: model(x, labels=x).float().mean().backward())
    record("host_syncs_per_step", recompute=recompute, by_iterations=counts)
    assert counts[4] == counts[1], counts


# ------------------------------------------------------------------------------------------------
# Transformer Engine spec
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ROLE_VARIANTS)
def test_te_spec_is_causal_and_matches_reference(seeded, variant):
    _transformer_engine()
    cfg = small_config(variant, hidden_size=128, seq_length=128)
    model = build_model(cfg, use_te=True, params_dtype=torch.bfloat16).cuda()
    assert_causal(model, _tokens(cfg), t=cfg.seq_length // 2)
    errors = model_vs_reference(model, cfg)
    record("te_spec_bf16_vs_fp64", variant=variant,
           worst=max(errors.items(), key=lambda kv: kv[1][0]))
    assert_parity(errors, floor=2e-2)


def _decoder_grads(model, x, labels):
    model.zero_grad(set_to_none=True)
    model(x, labels=labels).float().mean().backward()
    return torch.cat([p.grad.float().flatten() for p in model.decoder.parameters()])


def _same_weights(*models):
    state = models[0].state_dict()
    for other in models[1:]:
        other.load_state_dict(state)


def test_fp8_full_recompute_replays_the_first_pass_in_the_looped_decoder(seeded):
    """Decoder gradients with and without full recomputation agree under the default recipe
    (current scaling), as closely as bf16 ones do, and far closer than FP8 is to bf16. The
    delayed-scaling pair (refused by the config) is measured for the record."""
    _fp8("current")
    cfg = small_config("asymloop", iterations=3, hidden_size=128, ffn_hidden_size=256,
                       seq_length=128)
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    recompute = ParallelConfig(recompute="full")
    grads, weights = {}, None
    for name, fp8, parallel in (("bf16", None, None), ("bf16_recompute", None, recompute),
                                ("current", "current", None),
                                ("current_recompute", "current", recompute),
                                ("delayed", "delayed", None),
                                ("delayed_recompute", "delayed", recompute)):
        model = build_model(cfg, parallel, use_te=True, params_dtype=torch.bfloat16,
                            fp8=fp8).cuda()
        weights = weights or model.state_dict()
        model.load_state_dict(weights)
        for _ in range(2):  # the second pass runs with the scales the first one set
            grads[name] = _decoder_grads(model, x, labels)
    bf16 = grads["bf16"]
    distance = {name: relative_error(grads[name], bf16.double())
                for name in ("bf16_recompute", "current", "current_recompute")}
    distance["current_recompute_vs_current"] = relative_error(grads["current_recompute"],
                                                              grads["current"].double())
    distance["delayed_recompute_vs_delayed"] = relative_error(grads["delayed_recompute"],
                                                              grads["delayed"].double())
    record("fp8_recompute_decoder_grads", **distance)
    assert distance["current_recompute_vs_current"] <= max(2 * distance["bf16_recompute"], 1e-3)
    assert distance["current_recompute_vs_current"] < 0.1 * distance["current"], distance


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_global_kv_projection_runs_in_the_decoders_fp8_recipe(seeded, recipe):
    """The Global K/V projection, run outside the decoder block, quantises in FP8 with the
    recipe the decoder's own linears use (Transformer Engine runs a linear called outside an
    FP8 context in bf16), and its weight gradient stays as close to bf16's as FP8 allows."""
    _fp8(recipe)
    cfg = small_config("asymloop", iterations=3, hidden_size=128, ffn_hidden_size=256,
                       seq_length=128)
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    grads, weights = {}, None
    for fp8 in (None, recipe):
        model = build_model(cfg, use_te=True, params_dtype=torch.bfloat16, fp8=fp8).cuda()
        weights = weights or model.state_dict()
        model.load_state_dict(weights)
        for _ in range(2):  # the second pass runs with the scales the first one set
            _decoder_grads(model, x, labels)
        attention = [layer.self_attention for layer in model.decoder.layers]
        grads[fp8] = torch.cat([a.linear_kv_global.weight.grad.float().flatten()
                                for a in attention])
    for a in attention:
        assert a.linear_kv_global.fp8 and a.linear_qkv.fp8
        assert (type(a.linear_kv_global.fp8_meta["recipe"])
                is type(a.linear_qkv.fp8_meta["recipe"]))
    error = relative_error(grads[recipe], grads[None].double())
    record("fp8_global_kv_weight_grad_vs_bf16", recipe=recipe, error=error)
    assert error < 0.25, error  # FP8 rounding; a scale that does not fit the tensor is order 1


def _amax_and_scale_per_call(model, x, labels, micro_batches):
    """(amax, scale) of every forward call of each decoder FP8 GEMM's input, from Transformer
    Engine's delayed-scaling state: the amax of this call and the scale it was quantised with."""
    calls = []

    def read(module, inputs, output):
        if not getattr(module, "fp8", False):  # ran outside FP8
            return
        meta = module.fp8_meta["scaling_fwd"]
        calls.append((meta.amax_history[0][0].item(), meta.scale[0].item()))

    modules = [m for m in model.decoder.modules() if hasattr(m, "fp8_meta")]
    assert modules, "no Transformer Engine FP8 modules in the decoder"
    hooks = [m.register_forward_hook(read) for m in modules]
    for step in range(micro_batches):
        _decoder_grads(model, x.roll(step, dims=1), labels)
    for hook in hooks:
        hook.remove()
    return calls


def test_delayed_scaling_defaults_cover_every_iteration(seeded):
    """With the looped-block defaults (amax history of 2K calls, max), no decoder FP8 input
    exceeds the range its scale was set for; Transformer Engine's default (history 1, most
    recent: iteration t quantised with iteration t-1's amax) is measured for the record."""
    _fp8("delayed")
    cfg = small_config("asymloop", iterations=4, hidden_size=128, ffn_hidden_size=256,
                       seq_length=128)
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    worst = {}
    for setting in ("looped_defaults", "te_default"):
        model = build_model(cfg, use_te=True, params_dtype=torch.bfloat16, fp8="delayed").cuda()
        if setting == "te_default":
            for config in {id(m.config): m.config for m in model.modules()
                           if hasattr(m, "config")}.values():
                config.fp8_amax_history_len, config.fp8_amax_compute_algo = 1, "most_recent"
        calls = _amax_and_scale_per_call(model, x, labels, micro_batches=6)
        warm = calls[len(calls) // 3:]  # after the first micro-batches set the scales
        worst[setting] = max(amax * scale / E4M3_MAX for amax, scale in warm)
    record("fp8_delayed_amax_over_range", **worst)
    assert worst["looped_defaults"] <= 1.1, worst


def test_selective_core_attention_recompute_keeps_delayed_scaling_per_iteration(seeded):
    """Selective recomputation of the core attention, which the config allows with delayed
    scaling on looped models (full recomputation it refuses): megatron-core replays it with its
    own checkpoint and it holds no FP8 state, so every FP8 GEMM of the decoder sees the same
    amax and scale per call as without recomputation, and the gradients differ only as a bf16
    replay does."""
    _fp8("delayed")
    cfg = small_config("asymloop", iterations=3, hidden_size=128, ffn_hidden_size=256,
                       seq_length=128)
    x, labels = _tokens(cfg), _tokens(cfg, seed=1)
    selective = ParallelConfig(recompute="selective")
    calls, grads, weights = {}, {}, None
    for name, fp8, parallel in (("bf16", None, None), ("bf16_selective", None, selective),
                                ("delayed", "delayed", None),
                                ("delayed_selective", "delayed", selective)):
        model = build_model(cfg, parallel, use_te=True, params_dtype=torch.bfloat16,
                            fp8=fp8).cuda()
        weights = weights or model.state_dict()
        model.load_state_dict(weights)
        if fp8:
            calls[name] = _amax_and_scale_per_call(model, x, labels, micro_batches=3)
        grads[name] = _decoder_grads(model, x, labels)
    distance = {"bf16": relative_error(grads["bf16_selective"], grads["bf16"].double()),
                "delayed": relative_error(grads["delayed_selective"], grads["delayed"].double())}
    record("fp8_selective_recompute_decoder_grads", **distance)
    assert calls["delayed_selective"] == calls["delayed"]
    assert distance["delayed"] <= max(2 * distance["bf16"], 1e-3), distance


@pytest.mark.parametrize("ffn, refused", [(256, False), (264, True)])
def test_fp8_gemm_shape_check_agrees_with_transformer_engine(seeded, ffn, refused):
    """megaloop's set-up check (platform.fp8.check_fp8_shapes) refuses exactly the FFN width
    Transformer Engine's FP8 forward asserts on (264 = 16 x 16.5), and takes one it runs."""
    _fp8("current")
    from megaloop.config import ConfigError, RunConfig, TrainConfig
    from megaloop.platform.fp8 import check_fp8_shapes

    cfg = small_config("asymloop", hidden_size=128, ffn_hidden_size=ffn, seq_length=128)
    x = _tokens(cfg)  # 2 x 128 tokens
    run = RunConfig(model=cfg, train=TrainConfig(precision="fp8", micro_batch_size=x.shape[0]))
    model = build_model(cfg, use_te=True, params_dtype=torch.bfloat16, fp8="current").cuda()
    if not refused:
        check_fp8_shapes(run)
        model(x)
        return
    with pytest.raises(ConfigError, match=f"ffn_hidden_size = {ffn} is a GEMM inner"):
        check_fp8_shapes(run)
    with pytest.raises(AssertionError, match="FP8 execution requires"):
        model(x)


def _roundtrip(source, target):
    from megatron.core import dist_checkpointing

    from megaloop.training.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        dist_checkpointing.save(source.sharded_state_dict(), directory)
        state = load_checkpoint(Path(directory), target.sharded_state_dict())
    target.load_state_dict(state)


def _reference_weights(model):
    return to_reference_state_dict({k: v for k, v in model.state_dict().items()
                                    if isinstance(v, torch.Tensor)}, model.cfg)


@pytest.mark.parametrize("variant", ["dense_olmo", "asymloop", "asymloop_no_local_kv"])
def test_checkpoints_move_between_local_and_te_specs(seeded, variant):
    _transformer_engine()
    cfg = small_config(variant, hidden_size=128, seq_length=128)
    x = _tokens(cfg)
    for source_te in (False, True):
        source = build_model(cfg, use_te=source_te, params_dtype=torch.bfloat16).cuda()
        target = build_model(cfg, use_te=not source_te, params_dtype=torch.bfloat16).cuda()
        _roundtrip(source, target)
        expected, loaded = _reference_weights(source), _reference_weights(target)
        assert expected.keys() == loaded.keys()
        for name in expected:
            assert torch.equal(expected[name], loaded[name]), name
        with torch.no_grad():
            error = relative_error(target(x), source(x).double())
        record("checkpoint_between_specs", variant=variant, from_te=source_te, logits=error)
        assert error < 2e-2
