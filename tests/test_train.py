"""The megaloop-train entry point: layered configuration and one-line errors with exit code 2."""

import pytest

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


@pytest.mark.parametrize("argv, message", [
    (["model.hiden_size=3"], "error: unknown field model.hiden_size (did you mean hidden_size?)"),
    ([], "error: data.path=[]: must be a non-empty list of dataset prefixes"),
    (["--preset", "2B"], "error: --preset '2B': unknown"),
    (["data.path=[/nonexistent/prefix]", "data.eod_id=0", "train.out_dir=OUT"],
     "error: /nonexistent/prefix.idx: not found"),
])
def test_user_mistakes_are_one_line_errors(capsys, tmp_path, argv, message):
    argv = [a.replace("OUT", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message), err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_config_file_errors_name_the_file(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    save_yaml(RunConfig(model=ModelConfig(hidden_size=130)), path)
    assert main(["--config", str(path), "data.path=[x]", "data.eod_id=0"]) == 2
    assert "model.hidden_size=130: must be a multiple of num_attention_heads" in capsys.readouterr().err
