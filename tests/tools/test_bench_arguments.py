"""tools/bench/: a size or count below its minimum is an argparse error naming the flag, before
any work (it was a traceback, e.g. "no median for empty data" for --repeats 0)."""

import sys

import pytest


@pytest.mark.parametrize("bench, flag", [
    ("alrs", "--reps"), ("preprocess", "--rounds"), ("pipeline_balance", "--steps"),
    ("latent_visit", "--repeats"), ("moe_layer", "--repeats"), ("joint_attention", "--repeats"),
    ("step_time", "--repeats"), ("train_throughput", "--rounds"),
])
def test_a_count_below_one_is_refused_naming_the_flag(load_tool, monkeypatch, capsys, bench,
                                                      flag):
    main = load_tool(f"bench/{bench}").main
    monkeypatch.setattr(sys, "argv", [f"{bench}.py", flag, "0"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument {flag}: 0: must be >= 1\n")


@pytest.mark.parametrize("bench, argv, message", [
    ("export_memory", ["--arch", "asym"], "model.arch='asym': must be one of 'dense', 'fullloop', "
                                          "'asymloop', 'latentloop'"),
    ("generate", ["--preset", "2B"], "preset '2B': unknown; choose one of tiny, 60M"),
    ("step_time", ["--preset", "2B"], "preset '2B': unknown; choose one of tiny, 60M"),
    ("checkpoint_save_memory", ["--preset", "2B"], "preset '2B': unknown; choose one of tiny"),
])
def test_an_unknown_preset_or_arch_is_one_argparse_line(load_tool, capsys, bench, argv, message):
    """Before: a ConfigError traceback (a bare KeyError for an unknown arch)."""
    with pytest.raises(SystemExit) as exit_:
        load_tool(f"bench/{bench}").main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err.splitlines()[-1] and "Traceback" not in err
