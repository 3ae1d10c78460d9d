"""tools/flops.py: every preset is counted with its own vocabulary and sequence length, and the
LatentLoop family table shows what the compressed visit saves."""

from megaloop.models.flops import parameter_count
from megaloop.presets import preset


def test_rows_use_each_presets_own_vocabulary(load_tool):
    rows = load_tool("flops").matched_depth_rows("olmo")
    dense = preset("olmo", arch="dense", num_layers=2 * preset("olmo").num_layers)
    assert dense.vocab_size == 49152
    assert rows["dense_params"] == parameter_count(dense)


def test_latentloop_rows_show_the_compression_saving_at_matched_budgets(load_tool):
    rows = {r["preset"]: r for r in load_tool("flops").latentloop_rows("3B")}
    assert rows["moe-loop-3B"]["compression_saving_pct"] == 0.0
    assert 10 < rows["latentloop-3B"]["compression_saving_pct"] < 50
    assert rows["latentloop-3B"]["active_params"] < rows["latentloop-3B"]["params"]
    assert abs(rows["latentloop-3B"]["gflops_per_token"] / rows["moe-loop-3B"]["gflops_per_token"]
               - 1) < 0.01


def test_a_measured_count_off_the_analytical_one_names_it(load_tool, monkeypatch, capsys):
    """Before: exit 1 with only the JSON, which the reader had to search for the culprit."""
    tool = load_tool("flops")
    rows = {"asymloop": 0.2, "asymloop_moe": -3.5, "latentloop": 0.0}
    measured = iter(rows.values())

    def measure(cfg):
        diff = next(measured)
        return dict(measured=[dict(phase="backward", recompute="full", modules=[],
                                   counted=100 + diff, analytical=100.0, rel_diff_pct=diff)],
                    skipped=[])

    monkeypatch.setattr(tool, "measure", measure)
    assert tool.main(["--measure"]) == 1
    assert capsys.readouterr().err == ("error: asymloop_moe backward (recompute=full): counted "
                                       "96.5 FLOPs per token, analytical 100 (-3.50%, more than "
                                       "1%)\n")
    measured = iter([0.2, -0.5, 0.0])
    assert tool.main(["--measure"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["model", "phase", "recompute", "|", "counted", "analytical", "|",
                                "difference"]
    assert table[3].split() == ["asymloop_moe", "backward", "full", "|", "99.5", "100", "|",
                                "-0.50%"]


def test_json_means_json_with_measure_too(load_tool, monkeypatch, capsys):
    """Before: --measure printed JSON with or without --json (which did nothing)."""
    import json

    tool = load_tool("flops")
    monkeypatch.setattr(tool, "measure", lambda cfg: dict(measured=[dict(
        phase="forward", recompute="none", modules=[], counted=100.0, analytical=100.0,
        rel_diff_pct=0.0)], skipped=[]))
    assert tool.main(["--measure", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in results] == ["asymloop", "asymloop_moe", "latentloop"]
    assert results[0]["measured"][0]["counted"] == 100.0


def test_measure_counts_every_selective_module_the_model_has(load_tool, mcore):
    """Before: --measure ran selective recomputation of core_attn only, so the replays of mlp,
    moe and shared_experts (and the shared expert's third run under both) went unchecked."""
    tool = load_tool("flops")
    cfg = preset("tiny", arch="asymloop", iterations=2, num_layers=2, hidden_size=32,
                 ffn_hidden_size=64, num_attention_heads=2, seq_length=16, vocab_size=64,
                 num_experts=2, moe_top_k=2, moe_layers="decoder", moe_shared_expert_size=32)
    result = tool.measure(cfg)
    backward = {tool.recompute_label(r): r for r in result["measured"] if r["phase"] == "backward"}
    assert set(backward) == {"none", "core_attn", "mlp", "moe", "shared_experts",
                             "moe+shared_experts", "full"}
    assert all(r["counted"] == r["analytical"] for r in result["measured"])
    # each replay costs FLOPs, the shared expert's third run under moe+shared_experts included
    assert (backward["none"]["counted"] < backward["shared_experts"]["counted"]
            < backward["moe"]["counted"] < backward["moe+shared_experts"]["counted"])
    skipped = {"+".join(s["modules"]): s["reason"] for s in result["skipped"]}
    assert set(skipped) == {"layernorm", "moe_act"}  # Transformer Engine only, not on this CPU
    assert all("Transformer Engine" in reason for reason in skipped.values())
