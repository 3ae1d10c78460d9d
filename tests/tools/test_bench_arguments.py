"""tools/bench/: a size or count below its minimum is an argparse error naming the flag, before
any work (it was a traceback, e.g. "no median for empty data" for --repeats 0); a stop signal
stops a bench that runs a Trainer in process."""

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


def test_train_throughput_stops_on_sigterm(load_tool, monkeypatch, capsys):
    """Its dense row builds a Trainer, which holds SIGTERM for a loop the bench does not run:
    before, `timeout` or `kill` was taken and the bench ran its 50-odd steps to the end."""
    import os
    import signal

    bench = load_tool("bench/train_throughput")
    steps = []

    def step_then_sigterm(self, data):  # one signal, as `timeout` sends
        if not steps:
            os.kill(os.getpid(), signal.SIGTERM)
        steps.append(1)

    monkeypatch.setattr(bench.PlainGPTLoop, "step", step_then_sigterm)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--rows", "dense", "--hidden", "32", "--heads", "2", "--layers", "1",
                    "--seq", "32", "--vocab", "256", "--steps", "2", "--rounds", "1"])
    # The signal is counted by a thread: the step after it may start first; the bench has 6.
    assert exit_.value.code == 128 + signal.SIGTERM and len(steps) <= 2
    assert capsys.readouterr().err.endswith("stopped by signal 15\n")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the trainer's handlers are gone


def test_a_failed_launch_is_one_error_with_its_reason(load_tool):
    """The looped row's torchrun launch refuses 3 heads of a 256-wide model: before, a
    CalledProcessError traceback ('returned non-zero exit status 1'), the reason left unread."""
    with pytest.raises(SystemExit) as exit_:
        load_tool("bench/train_throughput").main(["--rows", "looped", "--heads", "3",
                                                  "--rounds", "1"])
    assert exit_.value.code == ("error: the single launch failed (exit 1): model.hidden_size=256: "
                                "must be a multiple of num_attention_heads=3 (or set head_dim)")


def test_latent_visit_refuses_a_stride_no_reduction_reads(load_tool, capsys):
    """Before: --stride 4 --reductions width timed the width reduction; the stride did nothing."""
    with pytest.raises(SystemExit) as exit_:
        load_tool("bench/latent_visit").main(["--stride", "4", "--reductions", "width,top_k"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --stride 4: only the sequence reduction reads it; --reductions width,top_k times none")
