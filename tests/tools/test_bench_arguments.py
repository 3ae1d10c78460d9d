"""tools/bench/: a size or count below its minimum is an argparse error naming the flag, before
any work (it was a traceback, e.g. "no median for empty data" for --repeats 0)."""

import sys

import pytest


@pytest.mark.parametrize("bench, flag", [
    ("alrs", "--reps"), ("preprocess", "--rounds"), ("pipeline_balance", "--steps"),
    ("latent_visit", "--repeats"), ("moe_layer", "--repeats"), ("joint_attention", "--repeats"),
])
def test_a_count_below_one_is_refused_naming_the_flag(load_tool, monkeypatch, capsys, bench,
                                                      flag):
    main = load_tool(f"bench/{bench}").main
    monkeypatch.setattr(sys, "argv", [f"{bench}.py", flag, "0"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument {flag}: 0: must be >= 1\n")
