"""LatentLoop: no position sees a later token under any switch, stride or length; the compression
pools and writes back exactly as specified; visits share (or untie) the middle block's weights; a
compressed visit costs half the projection/expert FLOPs and a quarter of the score FLOPs."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaloop.config import ConfigError, ModelConfig, ParallelConfig
from megaloop.models.flops import register_cpu_flash_flop_formulas
from megaloop.models.latent import LatentCompression
from megaloop.models.model import build_model
from tests.models.variants import LATENT_VARIANTS, small_config


def _tokens(cfg, length, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=g)


@pytest.mark.parametrize("variant", list(LATENT_VARIANTS))
def test_no_position_sees_a_later_token_at_any_length(seeded, variant):
    """Every token t of sequences of the training length, odd lengths and lengths shorter than a
    group: changing t changes no logit before t (one batch row per perturbed position, and the
    unperturbed sequence as the last row of the same batch, so that all rows share one GEMM shape)."""
    cfg = small_config(variant)
    model = build_model(cfg).eval()
    exact = 1e-5 if cfg.uses_moe else 0  # see test_model: MoE GEMM blocking, not information
    for length in sorted({cfg.seq_length, cfg.seq_length - 1, cfg.seq_length - 3, 5, 2}):
        batch = _tokens(cfg, length, batch=1).repeat(length + 1, 1)
        positions = torch.arange(length)
        batch[positions, positions] = (batch[positions, positions] + 1) % cfg.vocab_size
        with torch.no_grad():
            out = model(batch)
        for t in range(length):
            torch.testing.assert_close(out[t, :t], out[-1, :t], atol=exact, rtol=0,
                                       msg=f"length {length}, token {t}")
        assert (out[0, 0] - out[-1, 0]).abs().max() > 1e-6, "token 0 must influence itself"


@pytest.mark.parametrize("stride, lag, length", [(2, 0, 8), (2, 0, 7), (3, 1, 11), (4, 0, 6),
                                                 (4, 1, 3)])
def test_compression_pools_groups_and_writes_each_update_to_its_receivers(mcore, stride, lag,
                                                                          length):
    """Latent i = mean of tokens ki..ki+k-1 (complete groups); its update goes to positions
    ki+k-1+l+s scaled by w_s, written out as an explicit loop."""
    config = build_model(small_config("latentloop")).config
    compression = LatentCompression(config, stride=stride, lag=lag)
    d = config.hidden_size
    with torch.no_grad():
        compression.channel_scales.copy_(torch.randn(stride * d))
    hidden = torch.randn(length, 2, d)
    latents = compression.pool(hidden)
    assert latents.shape[0] == length // stride
    for i in range(length // stride):
        torch.testing.assert_close(latents[i], hidden[i * stride:(i + 1) * stride].mean(0))
    delta = torch.randn_like(latents)
    expected = torch.zeros_like(hidden)
    scales = compression.channel_scales.view(stride, d)
    for i in range(length // stride):
        for s in range(stride):
            position = i * stride + stride - 1 + lag + s
            if position < length:
                expected[position] += scales[s] * delta[i]
    torch.testing.assert_close(compression.write_back(delta, length), expected)
    assert not expected[:stride - 1 + lag].any(), "the first k-1+l positions receive nothing"


def test_latents_take_the_rotary_position_of_their_last_token(mcore):
    model = build_model(small_config("latentloop_stride3_lag1"))
    rope = model.rotary_pos_emb(12)
    compression = model.visits.visit1.compression
    torch.testing.assert_close(compression.latent_rope(rope, 4), rope[[2, 5, 8, 11]])


def test_visits_share_the_middle_block_unless_untied(seeded):
    shared = build_model(small_config("latentloop_moe"))
    assert all(visit.block is shared.decoder for visit in shared.visits)
    untied = build_model(small_config("latentloop_moe_untied_v3"))
    owner = untied.decoder.layers[0]
    blocks = [visit.block for visit in untied.visits]
    assert blocks[0] is untied.decoder
    for block in blocks[1:]:
        assert block.layers[0].self_attention is not owner.self_attention
        assert block.layers[0].mlp is not owner.mlp
    topk = build_model(small_config("latentloop_moe_topk"))
    reduced, full = (visit.block.layers[0].mlp for visit in topk.visits)
    assert full is topk.decoder.layers[0].mlp and reduced is not full
    assert (reduced.router.topk, full.router.topk) == (2, 4)
    # The reduced visit routes with the shared router weight and experts, held once.
    assert reduced.router.weight is full.router.weight
    assert all(a.linear_fc1.weight is b.linear_fc1.weight for a, b in zip(
        reduced.experts.local_experts, full.experts.local_experts))
    names = [name for name, _ in topk.named_parameters()]
    assert len(names) == len(set(names)) and not any("visits.visit1.block" in n for n in names)


def _weights_in_forward(module):
    """The module's ``weight`` as its forward saw it, after the next call."""
    seen = []
    module.register_forward_hook(lambda m, args, out: seen.append(m.weight), prepend=True)
    return seen


@pytest.mark.parametrize("variant", ["latentloop_moe_width", "latentloop_moe_expert_ffn"])
def test_narrowed_visits_compute_with_parts_of_the_shared_weights(seeded, variant):
    """width: the leading d/2 columns (rows) of every shared matrix, through learned projections;
    expert_ffn: the first half of each expert's hidden units, gate and up alike. Nothing of the
    visit's block is a parameter of its own, and gradients reach the shared weights."""
    model = build_model(small_config(variant))
    cfg, d = model.cfg, model.cfg.hidden_size
    layer, owner = model.visits.visit1.block.layers[0], model.decoder.layers[0]
    qkv, fc1, fc2 = (_weights_in_forward(m) for m in (
        layer.self_attention.linear_qkv, layer.mlp.experts.local_experts[0].linear_fc1,
        layer.mlp.shared_experts.linear_fc2))
    x = _tokens(cfg, cfg.seq_length)
    model(x, labels=x).mean().backward()
    shared_qkv = owner.self_attention.linear_qkv.weight
    shared_fc1 = owner.mlp.experts.local_experts[0].linear_fc1.weight
    shared_fc2 = owner.mlp.shared_experts.linear_fc2.weight
    if variant.endswith("width"):
        assert qkv[0].data_ptr() == shared_qkv.data_ptr()  # a view, no copy
        torch.testing.assert_close(qkv[0], shared_qkv[:, :d // 2], rtol=0, atol=0)
        torch.testing.assert_close(fc1[0], shared_fc1[:, :d // 2], rtol=0, atol=0)
        torch.testing.assert_close(fc2[0], shared_fc2[:d // 2], rtol=0, atol=0)
        assert model.visits.visit1.projection.down_weight.shape == (d // 2, d)
    else:
        assert qkv[0] is shared_qkv
        units = cfg.moe_ffn_hidden_size
        gate, up = shared_fc1[:units // 2], shared_fc1[units:units + units // 2]
        torch.testing.assert_close(fc1[0], torch.cat([gate, up]), rtol=0, atol=0)
        torch.testing.assert_close(fc2[0], shared_fc2[:, :cfg.moe_shared_expert_size // 2],
                                   rtol=0, atol=0)
    assert not any("visits.visit1.block" in name for name, _ in model.named_parameters())
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("variant", ["latentloop_moe", "latentloop_moe_untied_v3",
                                     "latentloop_moe_topk", "latentloop_moe_width"])
def test_full_recompute_gives_identical_loss_and_gradients(seeded, variant):
    cfg = small_config(variant)
    plain = build_model(cfg)
    recomputed = build_model(cfg, ParallelConfig(recompute="full"))
    recomputed.load_state_dict(plain.state_dict())
    x = _tokens(cfg, cfg.seq_length)
    for m in (plain, recomputed):
        m(x, labels=x).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_learned_scales_are_trained_and_fixed_scales_are_not_parameters(seeded):
    learned = build_model(small_config("latentloop"))
    x = _tokens(learned.cfg, learned.cfg.seq_length)
    learned(x, labels=x).mean().backward()
    for visit in learned.visits:
        assert visit.residual_scale.grad.abs().sum() > 0
    assert learned.visits.visit1.compression.channel_scales.grad.abs().sum() > 0
    fixed = build_model(small_config("latentloop_moe_untied_v3"))
    assert not any("residual_scale" in name for name in fixed.state_dict())
    assert [v.residual_scale.item() for v in fixed.visits] == [0.25, 1.0, 0.5]


def _matmul_and_attention_flops(counter, module_name):
    counts = counter.get_flop_counts()[module_name]
    attention = sum(c for op, c in counts.items() if "scaled_dot_product" in str(op))
    return sum(counts.values()) - attention, attention


def test_compressed_visit_costs_half_the_matmuls_and_a_quarter_of_the_scores(seeded):
    register_cpu_flash_flop_formulas()
    cfg = small_config("latentloop_moe", moe_top_k=4)
    model = build_model(cfg).eval()  # eval: expert matmuls equal per token whatever the routing
    with FlopCounterMode(display=False) as counter:
        model(_tokens(cfg, cfg.seq_length))
    compressed = _matmul_and_attention_flops(counter, "LatentLoopLM.visits.visit1")
    full = _matmul_and_attention_flops(counter, "LatentLoopLM.visits.visit2")
    assert compressed[0] * 2 == full[0]
    assert compressed[1] * 4 == full[1]


def test_width_visit_halves_the_layer_matmuls_and_keeps_the_scores(seeded):
    """Every layer matmul has one d side, which halves; the attention scores do not change (same
    heads and head dim); the projections d -> d/2 -> d add 2d^2 per position."""
    register_cpu_flash_flop_formulas()
    cfg = small_config("latentloop_moe_width")
    model = build_model(cfg).eval()
    tokens = _tokens(cfg, cfg.seq_length)
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    reduced = _matmul_and_attention_flops(counter, "LatentLoopLM.visits.visit1")
    block = _matmul_and_attention_flops(counter, "LatentLoopLM.visits.visit1.block")
    full = _matmul_and_attention_flops(counter, "LatentLoopLM.visits.visit2")
    assert block[0] * 2 == full[0] and block[1] == full[1] == reduced[1]
    assert reduced[0] - block[0] == 2 * cfg.hidden_size ** 2 * tokens.numel()


def test_expert_ffn_visit_halves_the_expert_matmuls_only(seeded):
    register_cpu_flash_flop_formulas()
    cfg = small_config("latentloop_moe_expert_ffn")
    model = build_model(cfg).eval()
    with FlopCounterMode(display=False) as counter:
        model(_tokens(cfg, cfg.seq_length))
    counts = {name: sum(c.values()) for name, c in counter.get_flop_counts().items()}

    def flops(visit, part):  # over the middle layers (visit 2 has its own attention here)
        return sum(counts[f"LatentLoopLM.visits.visit{visit}.block.layers.{i}.{part}"]
                   for i in range(cfg.num_decoder_layers))

    for part in ("mlp.experts", "mlp.shared_experts"):
        assert flops(1, part) * 2 == flops(2, part) > 0
    for part in ("self_attention", "mlp.router"):
        assert flops(1, part) == flops(2, part) > 0
    halved = (flops(2, "mlp.experts") + flops(2, "mlp.shared_experts")) // 2
    assert counts["LatentLoopLM.visits.visit1"] == counts["LatentLoopLM.visits.visit2"] - halved


@pytest.mark.parametrize("fields, parallel, message", [
    (dict(latent_stride=5, seq_length=20), {}, "model.latent_stride=5: must be 2, 3 or 4"),
    (dict(latent_visits=[3]), {}, "model.latent_visits=[3]: must be distinct visit numbers in "
                                  "[1, iterations=2]"),
    (dict(num_layers=2, prelude_layers=1, coda_layers=1), {}, "model.coda_layers=1: must be >= 0 "
                                                             "with prelude_layers + coda_layers"),
    (dict(latent_reduction="top_k", num_experts=8, moe_top_k=2), {},
     "model.latent_reduction='top_k': must be 'sequence' unless num_experts > 0 and "
     "moe_top_k >= 4"),
    (dict(latent_reduction="width", hidden_size=65, head_dim=16), {},
     "model.hidden_size=65: must be even for latent_reduction='width'"),
    (dict(latent_reduction="expert_ffn"), {}, "model.latent_reduction='expert_ffn': must be one "
                                              "of 'sequence', 'width' unless num_experts > 0"),
    (dict(latent_reduction="expert_ffn", num_experts=4, moe_ffn_hidden_size=33), {},
     "model.moe_ffn_hidden_size=33: must be even for latent_reduction='expert_ffn'"),
    (dict(latent_reduction="expert_ffn", num_experts=4, moe_shared_expert_size=15), {},
     "model.moe_shared_expert_size=15: must be even for latent_reduction='expert_ffn'"),
    (dict(latent_reduction="width", latent_visits=[2], untie_attention=True), {},
     "model.latent_visits=[2]: must be visits that use the shared middle block for "
     "latent_reduction='width' (visits [2] have untied weights"),
    (dict(latent_reduction="expert_ffn", num_experts=4, latent_visits=[1, 2], untie_moe=True), {},
     "model.latent_visits=[1, 2]: must be visits that use the shared middle block for "
     "latent_reduction='expert_ffn' (visits [2] have untied weights"),
    (dict(latent_reduction="width", latent_stride=4), {},
     "model.latent_stride=4: must be left at its default 2 unless latent_reduction='sequence'"),
    (dict(latent_visits=[], latent_writeback_lag=1), {},
     "model.latent_writeback_lag=1: must be left at its default 0 while latent_visits is empty"),
    (dict(latent_visits=[], latent_reduction="width"), {},
     "model.latent_reduction='width': must be left at its default 'sequence' while latent_visits "
     "is empty"),
    (dict(residual_scale_init=[1.0]), {}, "model.residual_scale_init=[1.0]: must be empty or "
                                          "one value per visit"),
    (dict(untie_moe=True), {}, "model.untie_moe=True: must be false unless num_experts > 0"),
    # Before: accepted, and nothing untied (only visits 2..V get weights of their own).
    (dict(iterations=1, untie_attention=True), {},
     "model.untie_attention=True: must be false with iterations=1 (a single visit has no other"),
    (dict(iterations=1, untie_moe=True, num_experts=4), {},
     "model.untie_moe=True: must be false with iterations=1"),
    (dict(arch="asymloop", iterations=3, latent_stride=4), {},
     "model.latent_stride=4: must be left at its default 2 unless arch=latentloop"),
    (dict(), dict(pipeline=2), "parallel.pipeline=2: must be 1 for model.arch=latentloop"),
    (dict(), dict(tensor=2, sequence_parallel=True),
     "parallel.sequence_parallel=True: must be false for model.arch=latentloop"),
])
def test_bad_latentloop_configurations_are_one_line_errors(fields, parallel, message):
    with pytest.raises(ConfigError) as err:
        cfg = ModelConfig(**{**dict(arch="latentloop", seq_length=16, num_layers=4), **fields})
        cfg.validate()
        ParallelConfig(**parallel).validate(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_test_time_depth_is_refused(seeded):
    cfg = small_config("latentloop")
    with pytest.raises(ValueError, match="num_iterations=3: arch=latentloop runs exactly"):
        build_model(cfg)(_tokens(cfg, 8), num_iterations=3)


def test_parameter_count_grows_with_untied_parts_and_projections_exactly(seeded):
    base = small_config("latentloop_moe")
    counts = {}
    for name, fields in (("tied", {}), ("attention", dict(untie_attention=True)),
                         ("moe", dict(untie_moe=True)), ("top_k", dict(latent_reduction="top_k",
                                                                       moe_top_k=4)),
                         ("width", dict(latent_reduction="width")),
                         ("expert_ffn", dict(latent_reduction="expert_ffn"))):
        counts[name] = sum(p.numel() for p in build_model(dataclasses.replace(base, **fields))
                           .parameters())
    d, q = base.hidden_size, base.num_attention_heads * base.kv_channels
    g = base.num_query_groups * base.kv_channels
    attention = d + d * (q + 2 * g) + q * d  # input norm, QKV, output projection
    middle = base.num_layers - 2
    assert counts["attention"] - counts["tied"] == middle * attention
    ffn = d + base.num_experts * (d + 3 * d * base.moe_ffn_hidden_size)
    assert counts["moe"] - counts["tied"] == middle * ffn
    # The reduced visits compute with the shared weights; width adds its two projections.
    assert counts["top_k"] == counts["expert_ffn"] == counts["tied"] - d * base.latent_stride
    assert counts["width"] - counts["expert_ffn"] == d * d
