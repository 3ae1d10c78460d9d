"""tools/match_budget.py: the LatentLoop family presets are matched to their MoE Loop baseline
within 1% on parameters, KV cache per token and training FLOPs per token, and the search finds them."""

import json

import pytest

from megaloop.config import ConfigError
from megaloop.models.flops import budget
from megaloop.presets import LATENTLOOP_TIERS, preset


@pytest.mark.parametrize("tier", list(LATENTLOOP_TIERS))
@pytest.mark.parametrize("family", ["latentloop", "moe-base"])
def test_family_presets_match_the_moe_loop_budget_within_one_percent(tier, family):
    reference, matched = budget(preset(f"moe-loop-{tier}")), budget(preset(f"{family}-{tier}"))
    for key in ("parameters", "kv_cache_per_token", "train_flops_per_token"):
        assert abs(matched[key] / reference[key] - 1) < 0.01, key
    assert preset(f"{family}-{tier}").moe_top_k == 8


def test_search_reproduces_the_stored_latentloop_widths(load_tool):
    tool = load_tool("match_budget")
    reference = preset("moe-loop-1.3B")
    found, errors = tool.match(reference, tool.target_structure(reference, "latentloop"))
    stored = preset("latentloop-1.3B")
    assert (found.hidden_size, found.head_dim, found.num_experts) == \
        (stored.hidden_size, stored.head_dim, stored.num_experts)
    assert max(abs(e) for e in errors.values()) < 0.01
    # The compressed visit saved FLOPs and KV cache: LatentLoop is wider, with larger heads.
    assert found.hidden_size > reference.hidden_size and found.head_dim > reference.kv_channels


def test_an_unreachable_tolerance_is_a_one_line_error(load_tool):
    tool = load_tool("match_budget")
    reference = preset("moe-loop-1.3B")
    with pytest.raises(ConfigError, match=r"no width within 1e-06 \(relative\)"):
        tool.match(reference, tool.target_structure(reference, "latentloop"), width_step=256,
                   tolerance=1e-6)


def test_a_width_step_that_leaves_no_width_to_search_says_so(load_tool):
    # Before: d = 0 alone was searched: "closest: 100.00%; widen the search (--width-step)".
    tool = load_tool("match_budget")
    reference = preset("moe-loop-1.3B")
    with pytest.raises(ConfigError, match=r"^--width-step 2000: no hidden size from 768 to 1536 "
                                          r"\(3/4 to 3/2 of the reference's\) is a multiple of "
                                          r"it$"):
        tool.match(reference, tool.target_structure(reference, "latentloop"), width_step=2000)


@pytest.mark.parametrize("reduction", ["top_k", "width", "expert_ffn"])
def test_every_first_visit_reduction_is_matched_with_its_own_savings(load_tool, reduction):
    tool = load_tool("match_budget")
    reference = preset("moe-loop-1.3B")
    found, errors = tool.match(reference, tool.target_structure(reference, "latentloop",
                                                                reduction))
    assert found.latent_reduction == reduction and max(abs(e) for e in errors.values()) < 0.01
    # These reductions keep visit 1's sequence, so its KV cache: the search keeps the reference's
    # head size, where the sequence compression's saved KV cache buys larger heads.
    assert found.head_dim == reference.kv_channels
    # Each saves FLOPs in visit 1 that the match spends on width.
    assert found.hidden_size > reference.hidden_size


@pytest.mark.parametrize("flag, value, message", [
    ("--width-step", "0", "0: must be >= 1"),
    ("--tokens-per-step", "-5", "-5: must be >= 1"),
    ("--steps", "0", "0: must be >= 1"),
    ("--tolerance", "0", "0.0: must be > 0"),
])
def test_a_non_positive_setting_is_refused_in_one_line(load_tool, capsys, flag, value, message):
    with pytest.raises(SystemExit) as stop:
        load_tool("match_budget").main(["--tier", "1.3B", flag, value])
    captured = capsys.readouterr()
    assert stop.value.code == 2 and captured.out == ""
    assert captured.err.splitlines()[-1].endswith(f"error: argument {flag}: {message}")


def test_tiers_may_be_given_comma_separated_or_flag_by_flag(load_tool, capsys):
    # Before: "--tier 1.3B,3B" was an invalid choice; a tier given twice was matched twice.
    tool = load_tool("match_budget")
    assert tool.main(["--tier", "1.3B,3B", "--tier", "1.3B", "--json"]) == 0
    assert [entry["tier"] for entry in json.loads(capsys.readouterr().out)] == ["1.3B", "3B"]
    with pytest.raises(SystemExit) as stop:
        tool.main(["--tier", "1.3B,2B"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: argument --tier: '2B': not a tier (choose from 1.3B, 3B, 7B)")


def test_a_failed_match_names_its_tier_and_target(load_tool, capsys):
    # Before: "error: no width within 0.003 (relative) ..." named neither: of the six matches of
    # a run over every tier, the user could not tell which had failed.
    tool = load_tool("match_budget")
    assert tool.main(["--tier", "1.3B", "--width-step", "64", "--tolerance", "0.003"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: tier 1.3B, moe_base: no width within 0.003 (relative) of the reference budget")
