"""tools/convert_checkpoint.py: both directions print a JSON report (a bfloat16 export comes back
as a bfloat16 checkpoint); bad input exits 2 with one line naming the file or value."""

import json

import pytest
import torch

from megaloop.config import DataConfig, RunConfig
from tests.models.variants import small_config


@pytest.fixture
def checkpoint(mcore, tmp_path):
    from megaloop.hf.checkpoint import build_single_process_model, save_weights_checkpoint

    cfg = small_config("asymloop")
    torch.manual_seed(0)
    model = build_single_process_model(cfg)
    return save_weights_checkpoint(model, RunConfig(model=cfg, data=DataConfig(eod_id=3)),
                                   tmp_path / "checkpoint")


def test_to_hf_and_back(load_tool, checkpoint, tmp_path, capsys):
    tool = load_tool("convert_checkpoint")
    assert tool.main(["to-hf", str(checkpoint.parent), str(tmp_path / "hf"), "--dtype",
                      "bfloat16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["class"] == "LoopedLM" and report["remote_code"]
    assert report["checkpoint"] == str(checkpoint)  # the directory's latest checkpoint
    assert report["dtype"] == "bfloat16"
    assert tool.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["arch"] == "asymloop" and (tmp_path / "back" / "latest").is_file()
    assert report["dtype"] == "bfloat16"


def test_bad_input_exits_2_with_one_line(load_tool, checkpoint, tmp_path, capsys):
    tool = load_tool("convert_checkpoint")
    assert tool.main(["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path / 'nowhere'}: no such checkpoint directory"
    assert tool.main(["to-hf", str(checkpoint), str(tmp_path / "hf"), "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: dtype 'bf16': an export stores float32, bfloat16, float16"
    (checkpoint / "metadata.json").unlink()
    assert tool.main(["to-hf", str(checkpoint), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {checkpoint / 'metadata.json'}: missing") and "\n" not in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(SystemExit) as exit_code:  # argparse: the two tokenizer flags conflict
        tool.main(["to-hf", str(checkpoint), str(tmp_path / "hf"), "--tokenizer", "t.model",
                   "--no-tokenizer"])
    assert exit_code.value.code == 2


def test_a_damaged_export_is_exit_2_not_a_traceback(load_tool, checkpoint, tmp_path, capsys):
    """Exit 1 means probe logits that differ (a bug); a cut-short file is bad input."""
    tool = load_tool("convert_checkpoint")
    assert tool.main(["to-hf", str(checkpoint.parent / "latest"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    weights = tmp_path / "hf" / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size - 1)
    assert tool.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {weights}: not a readable safetensors file") and "\n" not in err


def test_to_hf_exports_the_settings_a_config_changes_and_refuses_another_architecture(
        load_tool, checkpoint, tmp_path, capsys):
    """--config's test-time depth, context and RoPE base reach config.json (the probe checks the
    export against the checkpoint's model built with them); an architecture field is refused."""
    import yaml

    tool = load_tool("convert_checkpoint")
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    saved = dict(config["model"])
    config["model"].update(iterations=5, rotary_base=500000.0, seq_length=2048)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert tool.main(["to-hf", str(checkpoint), str(tmp_path / "hf"), "--config",
                      str(tmp_path / "cfg.yaml")]) == 0
    report = json.loads(capsys.readouterr().out)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["iterations"], exported["rotary_base"],
            exported["max_position_embeddings"]) == (5, 500000.0, 2048)
    assert report["settings_from_config"] == {
        "model.iterations": {"checkpoint": saved["iterations"], "export": 5},
        "model.rotary_base": {"checkpoint": saved["rotary_base"], "export": 500000.0},
        "model.seq_length": {"checkpoint": saved["seq_length"], "export": 2048}}

    config["model"].update(num_layers=saved["num_layers"] + 2, hidden_size=96)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    assert tool.main(["to-hf", str(checkpoint), str(tmp_path / "other"), "--config",
                      str(tmp_path / "cfg.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"model.num_layers={saved['num_layers']} in the checkpoint" in err
    assert f"model.hidden_size={saved['hidden_size']} in the checkpoint, 96 now" in err
    assert not (tmp_path / "other").exists()
