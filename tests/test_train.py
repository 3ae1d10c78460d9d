"""The megaloop-train entry point: layered configuration and one-line errors with exit code 2."""

import re
from pathlib import Path

import pytest

from tests.training.conftest import pattern_data  # noqa: F401  (a fixture)

from megaloop.config import save_yaml, RunConfig, ModelConfig
from megaloop.train import build_config, main


def test_layers_preset_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  arch: fullloop\n  iterations: 2\ntrain:\n  lr: 3.0e-4\n")
    cfg, _ = build_config(["--preset", "135M", "--config", str(path), "train.lr=1e-4",
                           "data.path=[x]", "data.eod_id=0"])
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (768, 12)  # from the preset
    assert (cfg.model.arch, cfg.model.iterations) == ("fullloop", 2)  # from the YAML
    assert cfg.train.lr == 1e-4  # the command line wins


def test_cli_and_api_presets_agree_on_iterations():
    from megaloop.presets import preset

    for arch in ("dense", "fullloop", "asymloop"):
        cfg, _ = build_config(["--preset", "135M", f"model.arch={arch}", "data.path=[x]",
                               "data.eod_id=0"])
        assert cfg.model.iterations == preset("135M", arch=arch).iterations


def test_help_names_every_preset(capsys, monkeypatch):
    """Before: --preset's help listed the seven He et al. and OLMo presets, not the LatentLoop
    family (moe-loop-3B, latentloop-tiny, ...) that --preset takes as well."""
    from megaloop.presets import PRESETS

    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no name wrapped at a hyphen
    with pytest.raises(SystemExit):
        build_config(["--help"])
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.strip().startswith("--preset PRESET"))
    assert all(name in line.split("(", 1)[1] for name in PRESETS), line


DATA = ["data.path=[DATA]", "data.eod_id=0", "train.out_dir=OUT"]


@pytest.mark.parametrize("argv, message", [
    (["model.hiden_size=3"], "error: unknown field model.hiden_size (did you mean hidden_size?)"),
    ([], "error: data.path=[]: must be a non-empty list of dataset prefixes"),
    (["--preset", "2B"], "error: --preset '2B': unknown"),
    (DATA + ["--preset", "moe-loop-1.3B", "model.arch=dense"],
     "error: model.arch='dense': preset 'moe-loop-1.3B' is an arch='latentloop' model"),
    (DATA + ["--world-size", "2"], "error: --world-size 2: only read with --dry-run"),
    # Before: the last one was read, silently replacing a job script's own (slurm/asymloop_7b.sh).
    (DATA + ["--preset", "7B", "--preset", "tiny"],
     "error: --preset given twice (7B, then tiny): one is read; give further settings as"),
    (["--config", "examples/configs/asymloop_7b.yaml", "--config", "mine.yaml"] + DATA,
     "error: --config given twice (examples/configs/asymloop_7b.yaml, then mine.yaml)"),
    (["data.path=[/nonexistent/prefix]", "data.eod_id=0", "train.out_dir=OUT"],
     "error: /nonexistent/prefix.idx: not found"),
    (["data.path=[DATA]", "data.tokenizer_model=/nonexistent/tok.model", "train.out_dir=OUT"],
     "error: data.tokenizer_model='/nonexistent/tok.model': /nonexistent/tok.model: tokenizer "
     "file not found"),
    (DATA + ["data.tokenizer_type=GPT2BPETokenizer"],
     "error: data.tokenizer_type='GPT2BPETokenizer': must be one of SentencePieceTokenizer"),
    (DATA + ["data.split=90;10"], "error: data.split='90;10': must be up to three non-negative"),
    (DATA + ["data.split=-1,2"], "error: data.split='-1,2': must be up to three non-negative"),
    (DATA + ["data.split=0,1,0"], "error: data.split='0,1,0': must be up to three non-negative"),
    (DATA + ["train.out_dir="], "error: train.out_dir='': must be a directory path"),
    (DATA + ["model.arch=dense", "model.iterations=1", "train.eval_depths=[1,2]"],
     "error: train.eval_depths=[1, 2]: must be empty for model.arch=dense"),
    (DATA + ["model.vocab_size=64", "model.hidden_size=64", "data.split=90,10,0"],
     "error: DATA.bin: token id 120 is outside the model's vocabulary (model.vocab_size=64)"),
])
def test_user_mistakes_are_one_line_errors(capsys, tmp_path, pattern_data, argv, message):
    argv = [a.replace("OUT", str(tmp_path)).replace("DATA", pattern_data) for a in argv]
    message = message.replace("DATA", pattern_data)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message), err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("setting", [
    "train.out_dir=~/runs/a", "checkpoint.dir=~/ckpt", "checkpoint.load=~/runs/b",
    "data.cache_dir=~/cache", "data.path=[~/data/x]", "data.tokenizer_model=~/tok.model",
    "train.profile.dir=~/profile"])
def test_a_path_starting_with_a_tilde_is_refused_naming_it(capsys, tmp_path, monkeypatch,
                                                          pattern_data, setting):
    """No shell expands ~ in section.field=~/x, nor does YAML: the run wrote into a directory
    named '~' in the working directory, its log lines naming ~/runs/a as if in the home."""
    monkeypatch.chdir(tmp_path)
    argv = [f"data.path=[{pattern_data}]", "data.eod_id=0", f"train.out_dir={tmp_path / 'run'}",
            "train.train_steps=2", "train.profile.steps=[1,1]", setting]
    if setting.startswith("data.tokenizer_model"):
        argv.remove("data.eod_id=0")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    key, _, value = setting.partition("=")
    shown = repr([value[1:-1]] if value.startswith("[") else value)
    assert err.startswith(f"error: {key}={shown}: must be a path without a leading '~'"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "~").exists()


def test_config_file_errors_name_the_file(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    save_yaml(RunConfig(model=ModelConfig(hidden_size=130)), path)
    assert main(["--config", str(path), "data.path=[x]", "data.eod_id=0"]) == 2
    assert "model.hidden_size=130: must be a multiple of num_attention_heads" in capsys.readouterr().err


def test_a_run_saves_its_resolved_config_readable_by_others(tmp_path, pattern_data, caplog):
    """... and says it starts at step 1 when there is no checkpoint (before: nothing said)."""
    import logging
    import os
    import stat

    from megaloop.config import load_yaml

    argv = [f"data.path=[{pattern_data}]", "data.eod_id=0", f"train.out_dir={tmp_path}",
            "data.split=90,10,0", "model.vocab_size=128", "model.hidden_size=32",
            "model.ffn_hidden_size=64", "model.seq_length=32", "train.train_steps=1",
            "train.eval_iters=1", "train.tensorboard=false"]
    previous = os.umask(0o022)
    caplog.set_level(logging.INFO, logger="megaloop.train")
    try:
        assert main(argv) == 0
    finally:
        os.umask(previous)
    fresh = f"no checkpoint in {tmp_path / 'checkpoints'}: the run starts at step 1"
    assert fresh in caplog.text
    caplog.clear()
    assert main(argv) == 0 and "the run is complete at step 1" in caplog.text  # relaunched
    assert fresh not in caplog.text
    expected, _ = build_config(argv)
    assert load_yaml(tmp_path / "config.yaml") == expected
    assert expected.model.encoder_layers == 2, "saved resolved"
    assert stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode) == 0o644


@pytest.mark.parametrize("size", ["0", "-2"])
def test_dry_run_refuses_a_world_of_no_ranks(capsys, size):
    with pytest.raises(SystemExit) as stop:
        main(["--dry-run", "--preset", "tiny", "--world-size", size, "data.path=[x]",
              "data.eod_id=0"])
    captured = capsys.readouterr()
    assert stop.value.code == 2 and captured.out == ""
    assert captured.err.splitlines()[-1].endswith(
        f"error: argument --world-size: {size}: must be >= 1")


def test_overrides_may_come_before_and_after_the_options():
    cfg, _ = build_config(["data.path=[x]", "--preset", "tiny", "train.lr=2e-3", "data.eod_id=0",
                           "--dry-run", "--world-size", "2", "model.arch=fullloop"])
    assert cfg.data.path == ["x"] and cfg.train.lr == 2e-3 and cfg.model.arch == "fullloop"
    assert cfg.model.hidden_size == build_config(["--preset", "tiny", "data.path=[x]",
                                                  "data.eod_id=0"])[0].model.hidden_size


# A stop signal that arrives once the run has ended (srun ending the job step while slower ranks
# finish their save) must not change the status the run ended with.
SIGNALLED_ON_THE_WAY_OUT = """
import atexit, os, signal, sys, time
import megaloop.train as train

train._run = lambda *args: 75  # a run stopped by preemption, its checkpoint saved

def signalled_while_exiting():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # a SIGTERM with its default action would end the process here

atexit.register(signalled_while_exiting)
sys.argv = ["megaloop-train"]
train.cli()
"""


def test_a_stop_signal_on_the_way_out_keeps_the_exit_status():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", SIGNALLED_ON_THE_WAY_OUT], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 75, result.stderr[-2000:]


# A typo in an override is answered before torch or megatron-core load (about 4 s of imports):
# the config, its errors and the list of bad-input errors import neither.
REPORTS_A_TYPO = """
import sys
from megaloop.train import main
code = main(["--preset", "tiny", "train.lr=1e-3", "trian.lr=1e-3"])
print(code, sorted(name for name in ("torch", "megatron.core") if name in sys.modules))
"""


def test_a_config_mistake_is_reported_without_loading_torch():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", REPORTS_A_TYPO], capture_output=True,
                            text=True, timeout=120)
    assert result.stdout == "2 []\n", result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


EXAMPLE_CONFIGS = sorted((Path(__file__).parents[1] / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda path: path.name)
def test_example_configs_validate_with_the_preset_their_header_names(path):
    """An example config sets an architecture and a recipe, its preset the dimensions: its header
    names the preset (before: it said "at LLaMA-2-7B dimensions", which the file alone does not
    give), and the two together validate."""
    header = path.read_text().split("\n\n")[0].split("\nmodel:")[0]
    preset = re.search(r"--preset (\S+)", header)
    assert preset, f"{path.name}: the header names no --preset"
    cfg, _ = build_config(["--preset", preset.group(1), "--config", str(path), "data.path=[x]",
                           "data.eod_id=0"])
    assert cfg.model.arch in header.lower()


@pytest.mark.parametrize("overrides, message", [
    (["alrs.exclude=[nosuch]"], "error: alrs.exclude=['nosuch']: 'nosuch' is in no weight matrix's name"),
    (["alrs.mode=decoder_boost", "alrs.decoder_prefix=decoder.layerz"],
     "error: alrs.decoder_prefix: 'decoder.layerz' starts no matrix name"),
])
def test_dry_run_refuses_alrs_names_the_run_would_refuse(mcore, capsys, overrides, message):
    """Before: the dry run printed its report and exited 0; the run then refused the names."""
    argv = ["--dry-run", "--preset", "tiny", "data.path=[x]", "data.eod_id=0", "train.use_alrs=true"]
    assert main(argv + overrides) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines()[-1].startswith(message)
    assert main(argv) == 0 and "# rank layout" in capsys.readouterr().out


def test_a_preset_a_complete_config_overrides_is_one_warning(tmp_path, caplog):
    """A run's saved config.yaml sets every model field: with it, --preset changes nothing.
    Before: ``--preset 60M --config runs/tiny/config.yaml`` trained the tiny model without a word."""
    import logging

    from megaloop.presets import preset

    saved = tmp_path / "config.yaml"
    save_yaml(RunConfig(model=preset("tiny", arch="asymloop", vocab_size=640)), saved)
    given = ["--config", str(saved), "data.path=[x]", "data.eod_id=0"]
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        cfg, _ = build_config(["--preset", "60M", *given])
        assert cfg.model.hidden_size == 128  # the config's
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith(
            f"--preset 60M: without effect, --config {saved} sets every model field it sets: "
            "model.num_layers=4 (the preset's 6), model.hidden_size=128 (the preset's 768)"), lines
        caplog.clear()
        build_config(["--preset", "tiny", *given, "model.vocab_size=4096"])  # the same model
        path = Path(__file__).parents[1] / "examples" / "configs" / "asymloop_7b.yaml"
        build_config(["--preset", "7B", "--config", str(path), "data.path=[x]", "data.eod_id=0"])
    assert caplog.records == []  # a preset agreeing with the config, or in effect


def test_a_preset_differing_only_where_overrides_set_the_model_is_no_warning(tmp_path, caplog):
    """The depth-matched Dense baseline (slurm/train_paper.sh 135M dense model.num_layers=24)
    relaunched with its saved config.yaml: the model is the preset's with the overrides given.
    Before: a warning naming model.num_layers=24 (the preset's 12), which the override set."""
    import logging

    from megaloop.presets import preset

    saved = tmp_path / "config.yaml"
    save_yaml(RunConfig(model=preset("135M", arch="dense", num_layers=24)), saved)
    with caplog.at_level(logging.WARNING, logger="megaloop.train"):
        cfg, _ = build_config(["--preset", "135M", "--config", str(saved), "model.arch=dense",
                               "model.num_layers=24", "data.path=[x]", "data.eod_id=0"])
        assert cfg.model.num_layers == 24 and caplog.records == []
        build_config(["--preset", "135M", "--config", str(saved), "data.path=[x]",
                      "data.eod_id=0"])  # the override not given: the preset's 12 is unread
    assert [r.getMessage().split(": ")[-1] for r in caplog.records] == [
        "model.num_layers=24 (the preset's 12); give one of the two"]


def test_an_override_given_twice_takes_the_last_and_says_so_once(tmp_path, caplog):
    """A job script's overrides come first and the user's after them, which replace them: the
    last stays in effect. Before: the first was dropped without a word (train.lr=1 train.lr=2)."""
    import logging

    saved = tmp_path / "config.yaml"
    save_yaml(RunConfig(), saved)
    given = ["data.path=[x]", "data.eod_id=0", "train.lr=1e-3", "train.seed=5", "train.lr=2e-3",
             "train.seed=5"]  # the same value again: nothing replaced
    with caplog.at_level(logging.INFO, logger="megaloop.config"):
        # With --preset and --config the overrides are applied thrice: still one line.
        cfg, _ = build_config(["--preset", "tiny", "--config", str(saved), *given])
    assert cfg.train.lr == 2e-3
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "megaloop.config"
            ] == [(logging.INFO, "override train.lr given twice: train.lr=1e-3, then "
                                 "train.lr=2e-3; the last is in effect")]
