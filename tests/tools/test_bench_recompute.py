"""tools/bench/recompute.py on a tiny AsymLoop: one JSON object with the recomputation arms side
by side, whose memory and FLOPs order is the one recomputation exists for."""

import json

import pytest

TINY = ["--hidden", "32", "--ffn", "64", "--heads", "2", "--layers", "2", "--seq", "64",
        "--vocab", "128", "--repeats", "1"]


def test_the_recompute_bench_reports_none_selective_and_full(load_tool, capsys):
    load_tool("bench/recompute").main([*TINY, "--joint-attention", "masked"])
    result = json.loads(capsys.readouterr().out)
    assert list(result["step_ms"]) == ["none", "core_attn", "full"]
    peak = result["peak_mib"]
    # The masked joint attention's probabilities (2 heads x 64 x 128 per token) are what
    # selective recomputation drops; full recomputation keeps only the layers' inputs.
    assert peak["full"] < peak["core_attn"] < peak["none"]
    flops = result["executed_flops_vs_none"]
    assert flops["none"] == 1.0 < flops["core_attn"] < flops["full"]


def test_the_ffn_modules_each_get_an_arm(load_tool, capsys):
    """Before: only core_attn was benchmarked; mlp, moe and shared_experts had no arm."""
    load_tool("bench/recompute").main([
        *TINY, "--experts", "4", "--shared-expert", "32", "--moe-layers", "decoder",
        "--selective", "mlp", "moe", "shared_experts", "moe,shared_experts"])
    result = json.loads(capsys.readouterr().out)
    arms = ["mlp", "moe", "shared_experts", "moe+shared_experts"]
    assert list(result["peak_mib"]) == ["none", *arms, "full"]
    flops = result["executed_flops_vs_none"]
    # each replays its FFNs' forward; with both, the shared expert runs a third time
    assert all(flops[arm] > 1.0 for arm in arms)
    assert flops["moe+shared_experts"] > flops["moe"] > flops["shared_experts"]
    peak = result["peak_vs_none"]
    assert all(peak[arm] < 1.0 for arm in arms)  # each drops its FFN's saved activations
    assert peak["moe+shared_experts"] <= peak["moe"] < peak["shared_experts"]


@pytest.mark.parametrize("args, error", [
    (["--selective", "moe"], "'moe': no MoE layer without model.num_experts > 0"),
    (["--shared-expert", "32"], "--shared-expert: needs --experts > 0"),
    (["--selective", "mlp", "mlp"], "--selective mlp mlp: each arm once"),
])
def test_a_module_or_option_the_model_lacks_is_one_line(load_tool, capsys, args, error):
    with pytest.raises(SystemExit) as exit:
        load_tool("bench/recompute").main([*TINY, *args])
    assert exit.value.code == 2
    assert error in capsys.readouterr().err.splitlines()[-1]
