"""megaloop checkpoint -> Hugging Face directory: logits equal to megaloop's (fp32, 1e-4) for every
architecture and ablation, native classes where they fit, self-contained remote code otherwise,
and every bad input refused in one line with nothing left in the output directory."""

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megaloop.hf.common import ConversionError, ProbeMismatch
from megaloop.hf.to_hf import REFERENCE_DIR, REMOTE_CODE_FILES, export_checkpoint
from megaloop.training.checkpoint import CheckpointError
from tests.hf.exports import NATIVE_VARIANTS, expected_class, sample_tokens
from tests.models.variants import ALL_VARIANTS


def load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True,
                                                dtype=torch.float32)


@pytest.mark.parametrize("variant", list(ALL_VARIANTS) + list(NATIVE_VARIANTS))
def test_export_gives_megaloop_logits(exports, variant):
    exported = exports.get(variant)
    assert exported.report["class"] == expected_class(variant)
    files = {p.name for p in exported.hf_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json"} <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
    umask = os.umask(0)
    os.umask(umask)
    assert (exported.hf_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    remote = exported.report["remote_code"]
    assert (set(REMOTE_CODE_FILES) <= files) == remote and bool(exported.report["why_remote_code"]) == remote
    config = json.loads((exported.hf_dir / "config.json").read_text())
    # The run's end-of-document id; no class default (Llama's bos 1, OLMo 2's pad 1) survives.
    assert (config["eos_token_id"], config.get("bos_token_id"), config.get("pad_token_id")) == \
        (3, None, None)
    with torch.no_grad():
        logits = load(exported.hf_dir)(sample_tokens(exported.cfg), use_cache=False).logits
    torch.testing.assert_close(logits, exported.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "dense", "latentloop_moe"])
def test_the_safetensors_are_what_transformers_saves_of_the_loaded_export(exports, variant,
                                                                          tmp_path):
    """The file is in the layout of the original checkpoints (a native MoE class's experts one
    tensor per expert, Mixtral's w1/w2/w3 under block_sparse_moe), as transformers' own
    save_pretrained writes it, though the export unstacks the experts itself."""
    from safetensors import safe_open

    exported = exports.get(variant)
    load(exported.hf_dir).save_pretrained(tmp_path / "again")
    with safe_open(exported.hf_dir / "model.safetensors", framework="pt") as ours, \
            safe_open(tmp_path / "again" / "model.safetensors", framework="pt") as theirs:
        names = sorted(ours.keys())
        assert names == sorted(theirs.keys())
        for name in names:
            assert torch.equal(ours.get_tensor(name), theirs.get_tensor(name)), name
    if variant == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names


def test_a_mapping_to_names_the_model_does_not_save_is_refused_naming_the_tensor(
        exports, tmp_path, monkeypatch):
    from megaloop.hf import native

    layer = {**native._LAYER, "mlp.router.weight": "mlp.router.weight"}
    monkeypatch.setattr(native, "_LAYER", layer)
    with pytest.raises(RuntimeError, match=r"^tensor model.layers.0.block_sparse_moe.gate.weight: "
                                           r"not mapped; the Hugging Face model saves it "
                                           r"\(shape \(4, 64\)\)$"):
        export_checkpoint(exports.get("mixtral").checkpoint, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_remote_code_is_the_reference_and_imports_only_torch_and_transformers(exports):
    """The shipped files are megaloop/reference's, byte for byte (no third definition)."""
    hf_dir = exports.get("asymloop").hf_dir
    for name in REMOTE_CODE_FILES:
        assert (hf_dir / name).read_bytes() == (REFERENCE_DIR / name).read_bytes()
        tree = ast.parse((hf_dir / name).read_text())
        modules = {alias.name.split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 0}
        # (and the standard library's modules, always there)
        assert modules <= {"__future__", "copy", "inspect", "math", "warnings", "torch",
                           "transformers"}, \
            (name, modules)


@pytest.mark.parametrize("variant", ["asymloop", "latentloop_stride3_lag1"])
def test_remote_code_generates_the_greedy_tokens_without_a_notice(exports, variant):
    """transformers (5.24) logs a notice about remote code whose forward names ``cache_position``
    (and makes one for it) on every first generate()."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    exported = exports.get(variant)
    model = load(exported.hf_dir)
    assert type(model).__module__.startswith("transformers_modules")  # the remote code
    prompt = sample_tokens(exported.cfg)[:1, :7]
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    library, verbosity = logging.getLogger("transformers"), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # the session runs quiet_transformers()
    hf_logging.warning_once.cache_clear()  # each notice once per process otherwise
    library.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    finally:
        library.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert [r.getMessage() for r in logged] == [] and [str(w.message) for w in warned] == []
    with torch.no_grad():  # each token the argmax of one full forward of what precedes it
        logits = model(out, use_cache=False).logits[0]
    assert out.shape == (1, 15) and torch.equal(out[0, 7:], logits[6:-1].argmax(-1))


def test_export_loads_and_generates_offline_without_megaloop(exports, tmp_path):
    """A fresh interpreter that cannot import megaloop, with the Hub unreachable."""
    dirs = [str(exports.get(v).hf_dir) for v in ("asymloop", "latentloop_moe_untied_v3")]
    script = ("import sys, torch\n"
              "from transformers import AutoModelForCausalLM\n"
              "assert 'megaloop' not in sys.modules\n"
              "for d in sys.argv[1:]:\n"
              "    m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)\n"
              "    out = m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)\n"
              "    print(type(m).__name__, out.shape[1])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    done = subprocess.run([sys.executable, "-c", script, *dirs], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["LoopedLM", "7", "LatentLoopLM", "7"]


# ------------------------------------------------------------------------------- bad input

def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "checkpoint"))


def _assert_nothing_written(out: Path):
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_refuses_a_checkpoint_of_another_architecture(exports, tmp_path):
    exported = exports.get("asymloop")
    other = dict(vars(exported.cfg), num_layers=6)
    from megaloop.config import ModelConfig

    with pytest.raises(CheckpointError, match=r"model.num_layers=4 in the checkpoint, 6 now"):
        export_checkpoint(exported.checkpoint, tmp_path / "out", requested=ModelConfig(**other))
    _assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("setting, refusal", [
    # LatentLoop runs only its own visits.
    ("iterations", r"^model.iterations=3: .*arch=latentloop runs exactly its iterations=2 visits"),
    # Learned residual scales are weights of the file (from_pretrained refuses it alike).
    ("residual_scale_init", r"^model.residual_scale_init=\[0.5, 1.0\]: .*without effect on a "
                            r"loaded model \(learned"),
])
def test_a_setting_the_export_cannot_take_is_refused_without_an_exported_warning(
        exports, tmp_path, caplog, setting, refusal):
    """Before: "exported with the config's model settings: model.iterations=3" was logged, then
    the refusal (two lines, the first saying what did not happen); residual_scale_init was written
    into config.json, without effect, with a warning that it was exported."""
    import logging

    from megaloop.config import ConfigError

    exported = exports.get("latentloop")
    value = exported.cfg.num_iterations + 1 if setting == "iterations" else [0.5, 1.0]
    requested = dataclasses.replace(exported.cfg, **{setting: value})
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        with pytest.raises(ConfigError, match=refusal):
            export_checkpoint(exported.checkpoint, tmp_path / "out", requested=requested)
    assert not [r for r in caplog.records if "config's model settings" in r.getMessage()]
    _assert_nothing_written(tmp_path / "out")


def test_a_depth_the_config_changes_is_exported_with_one_warning_naming_both(exports, tmp_path,
                                                                             caplog):
    """Before: config.json got the config's iterations without a word (only the JSON report's
    settings_from_config listed it)."""
    import logging

    exported = exports.get("asymloop")
    trained = exported.cfg.num_iterations
    requested = dataclasses.replace(exported.cfg, iterations=trained + 2)
    with caplog.at_level(logging.WARNING, logger="megaloop.hf"):
        export_checkpoint(exported.checkpoint, tmp_path / "out", requested=requested)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["iterations"] == trained + 2
    # (the other: these runs gave data.eod_id alone, so the tokenizer's size is unknown)
    assert [r.getMessage() for r in caplog.records if r.name == "megaloop.hf" and
            "tokenizer" not in r.getMessage()] == [
        f"{exported.checkpoint}: exported with the config's model settings, not those it was "
        f"trained with: model.iterations={trained + 2} (trained: {trained})"]


def test_a_hugging_face_directory_given_to_convert_names_from_hf(exports, tmp_path):
    """Before: only "no checkpoint there", for a directory that is the other direction's input."""
    hf_dir = exports.get("dense").hf_dir
    with pytest.raises(CheckpointError) as error:
        export_checkpoint(hf_dir, tmp_path / "out")
    message = str(error.value)
    assert message.startswith(f"{hf_dir}: no checkpoint there") and "\n" not in message
    assert message.endswith("; it holds config.json and *.safetensors, as a Hugging Face model "
                            "does: tools/convert_checkpoint.py from-hf converts that direction")
    _assert_nothing_written(tmp_path / "out")
    with pytest.raises(CheckpointError) as error:  # an empty directory: no such hint
        export_checkpoint(tmp_path, tmp_path / "other")
    assert "Hugging Face" not in str(error.value)


def test_refuses_an_incomplete_checkpoint_naming_the_file(exports, tmp_path):
    checkpoint = _copy(exports.get("asymloop").checkpoint, tmp_path)
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing"):
        export_checkpoint(checkpoint, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_refuses_tensors_that_do_not_fit_the_checkpoint_config_naming_the_tensor(exports,
                                                                                 tmp_path):
    checkpoint = _copy(exports.get("asymloop").checkpoint, tmp_path)
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    config["model"]["ffn_hidden_size"] = config["model"]["decoder_ffn_hidden_size"] = 80
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointError, match=r"cannot be loaded.*linear_fc1"):
        export_checkpoint(checkpoint, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_refuses_a_missing_tokenizer_naming_the_file(exports, tmp_path):
    checkpoint = _copy(exports.get("dense").checkpoint, tmp_path)
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    config["data"].update(tokenizer_model=str(tmp_path / "gone.model"), eod_id=None)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConversionError, match=r"gone.model: tokenizer file not found"):
        export_checkpoint(checkpoint, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")
    report = export_checkpoint(checkpoint, tmp_path / "out", with_tokenizer=False)
    assert report["tokenizer"] is None and not (tmp_path / "out" / "tokenizer.json").exists()


def test_refuses_an_existing_output_directory(exports, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        export_checkpoint(exports.get("dense").checkpoint, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_a_probe_mismatch_fails_loudly_and_leaves_nothing(exports, tmp_path, monkeypatch):
    """A wrong weight mapping (gate and up swapped) is caught by the probe."""
    from megaloop.hf import native

    layer = {**native._LAYER, "mlp.gate_proj.weight": "mlp.up_proj.weight",
             "mlp.up_proj.weight": "mlp.gate_proj.weight"}
    monkeypatch.setattr(native, "_LAYER", layer)
    with pytest.raises(ProbeMismatch, match="probe logits differ"):
        export_checkpoint(exports.get("dense").checkpoint, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_takes_the_latest_pointer_itself_and_names_a_file_given_for_a_checkpoint(exports,
                                                                                 tmp_path):
    """A shell completes runs/x/checkpoints/latest as readily as its directory."""
    checkpoint = exports.get("dense").checkpoint
    report = export_checkpoint(checkpoint.parent / "latest", tmp_path / "out")
    assert report["checkpoint"] == str(checkpoint)
    with pytest.raises(ConversionError, match=r"config.yaml: a file, not a checkpoint directory"):
        export_checkpoint(checkpoint / "config.yaml", tmp_path / "other")
    _assert_nothing_written(tmp_path / "other")


def test_a_tokenizer_problem_fails_before_the_weights_are_read(exports, tmp_path, monkeypatch):
    """Reading a large checkpoint takes minutes; a missing or too large tokenizer is known from
    its config alone."""
    from megaloop.hf import to_hf
    from tests.data.conftest import HF_TOKENIZER

    def read(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(to_hf, "load_checkpoint_model", read)
    checkpoint = exports.get("dense").checkpoint
    with pytest.raises(ConversionError, match=r"gone.model: tokenizer file not found"):
        export_checkpoint(checkpoint, tmp_path / "out", tokenizer=str(tmp_path / "gone.model"))
    if HF_TOKENIZER.is_file():  # GPT-2's 50257 tokens, the model's 128 rows
        with pytest.raises(ConversionError, match=r"50257 tokens, more than the model's "
                                                  r"vocab_size=128"):
            export_checkpoint(checkpoint, tmp_path / "out", tokenizer=str(HF_TOKENIZER))
    _assert_nothing_written(tmp_path / "out")


def test_an_output_directory_that_cannot_be_created_or_filled_meanwhile_is_one_line(
        exports, tmp_path, monkeypatch):
    from megaloop.hf import to_hf

    (tmp_path / "file").write_text("")
    with pytest.raises(ConversionError, match=r"file/out: cannot create it \(File exists: "):
        export_checkpoint(exports.get("dense").checkpoint, tmp_path / "file" / "out")
    write_tokenizer = to_hf._write_tokenizer

    def another_export_finishes_first(*args):  # a second export of the same OUT, say
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "theirs").write_text("")
        return write_tokenizer(*args)

    monkeypatch.setattr(to_hf, "_write_tokenizer", another_export_finishes_first)
    with pytest.raises(ConversionError, match=r"out: cannot move the conversion there "
                                              r"\(Directory not empty\)"):
        export_checkpoint(exports.get("dense").checkpoint, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["theirs"]


def test_a_full_disk_mid_export_is_one_line_through_the_tool_and_leaves_nothing(
        exports, tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as SafetensorError, not OSError: it was a traceback."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from tools import convert_checkpoint

    checkpoint = exports.get("dense").checkpoint  # exported before the disk fills

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "out"
    assert convert_checkpoint.main(["to-hf", str(checkpoint), str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {out}: the conversion stopped, nothing was written (No space "
                            "left on device; ") and error.endswith(" MiB free there)"), error
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_the_tokenizer_is_written_is_one_line(exports, tmp_path, monkeypatch):
    """An OSError (the tokenizer files, config.json) was a traceback too."""
    import errno

    from megaloop.hf import to_hf

    checkpoint = exports.get("dense").checkpoint

    def full_disk(path, tokenizer, with_tokenizer, staging):
        (staging / "tokenizer.json").write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device", str(staging / "tokenizer.json"))

    monkeypatch.setattr(to_hf, "_write_tokenizer", full_disk)
    with pytest.raises(ConversionError, match=r"out: the conversion stopped, nothing was written "
                                              r"\(No space left on device: .*tokenizer.json; "
                                              r"[0-9.]+ MiB free there\)$"):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_directory_without_latest_names_its_newest_checkpoint(exports, tmp_path):
    checkpoint = exports.get("dense").checkpoint
    directory = tmp_path / "checkpoints"
    shutil.copytree(checkpoint, directory / "iter_0000003")
    shutil.copytree(checkpoint, directory / "iter_0000006")
    (directory / "iter_0000009.tmp").mkdir()  # an interrupted save is not one to name
    with pytest.raises(ConversionError, match=rf"^{directory}: no 'latest' pointer beside its "
                                              rf"checkpoints; give the one to convert, e.g. the "
                                              rf"newest, {directory}/iter_0000006$"):
        export_checkpoint(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_pruned_by_its_run_while_exported_is_named_as_such(exports, tmp_path,
                                                                         monkeypatch):
    """A run still training saves iter_6 and prunes iter_3 (keep_last=1) while iter_3 is being
    exported: that was 'iter_0000003: no such checkpoint directory', as if mistyped."""
    from megaloop.hf import to_hf

    directory = tmp_path / "checkpoints"
    shutil.copytree(exports.get("dense").checkpoint, directory / "iter_0000003")
    (directory / "latest").write_text("iter_0000003\n")
    write_tokenizer = to_hf._write_tokenizer

    def the_run_saves_and_prunes(*args):
        written = write_tokenizer(*args)
        os.replace(directory / "iter_0000003", directory / "iter_0000006")
        (directory / "latest").write_text("iter_0000006\n")
        return written

    monkeypatch.setattr(to_hf, "_write_tokenizer", the_run_saves_and_prunes)
    with pytest.raises(ConversionError, match=rf"^{directory}/iter_0000003: removed while it was "
                                              r"being read \(a run still writing .* prunes older "
                                              r"checkpoints, checkpoint.keep_last\); 'latest' now "
                                              r"names iter_0000006: convert again"):
        export_checkpoint(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()
