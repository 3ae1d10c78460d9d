"""tools/bench/recompute.py on a tiny AsymLoop: one JSON object with the three recomputation
modes side by side, whose memory and FLOPs order is the one recomputation exists for."""

import json


def test_the_recompute_bench_reports_none_selective_and_full(load_tool, capsys):
    load_tool("bench/recompute").main([
        "--hidden", "32", "--ffn", "64", "--heads", "2", "--layers", "2", "--seq", "64",
        "--vocab", "128", "--repeats", "1", "--joint-attention", "masked"])
    result = json.loads(capsys.readouterr().out)
    assert set(result["step_ms"]) == {"none", "selective", "full"}
    peak = result["peak_mib"]
    # The masked joint attention's probabilities (2 heads x 64 x 128 per token) are what
    # selective recomputation drops; full recomputation keeps only the layers' inputs.
    assert peak["full"] < peak["selective"] < peak["none"]
    flops = result["executed_flops_vs_none"]
    assert flops["none"] == 1.0 < flops["selective"] < flops["full"]
