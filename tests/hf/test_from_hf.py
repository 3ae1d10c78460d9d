"""Hugging Face directory -> megaloop checkpoint: a round trip gives back the checkpoint's weights
bit for bit and its architecture; bad directories are refused in one line naming the tensor, field
or file, with nothing left in the output directory."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megaloop.config import RunConfig
from megaloop.hf.checkpoint import load_checkpoint_model, weights
from megaloop.hf.common import ConversionError
from megaloop.hf.from_hf import import_hf
from megaloop.training.checkpoint import check_compatible
from tests.hf.exports import StoragePeaks, fp32_weight_bytes


@pytest.mark.parametrize("variant", ["dense", "qwen3", "olmo2_one_head", "mixtral", "qwen3_moe",
                                     "dense_moe_shared", "fullloop_olmo", "asymloop_tied_gqa1",
                                     "asymloop_moe_decoder", "latentloop_moe_untied_v3",
                                     "latentloop_moe_width"])
def test_round_trip_is_exact(exports, variant, tmp_path):
    exported = exports.get(variant)
    report = import_hf(exported.hf_dir, tmp_path / "back")
    assert report["native_family"] == (None if exported.report["remote_code"]
                                       else json.loads((exported.hf_dir / "config.json")
                                                       .read_text())["model_type"])
    original, _, _ = load_checkpoint_model(exported.checkpoint)
    back, run, path = load_checkpoint_model(tmp_path / "back")
    check_compatible(path, RunConfig(model=exported.cfg))  # the same architecture fields
    before, after = weights(original), weights(back)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_the_end_of_document_id_comes_back_in_a_second_export(exports, tmp_path):
    """HF -> megaloop -> HF: eos_token_id 3 (the run's eod_id) stays; it was null, so that
    generate() of the second export never stopped at an end of document."""
    from megaloop.hf.to_hf import export_checkpoint

    assert import_hf(exports.get("dense").hf_dir, tmp_path / "back")["eod_id"] == 3
    export_checkpoint(tmp_path / "back", tmp_path / "again")
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "again" / name).read_text())["eos_token_id"] == 3


@pytest.mark.parametrize("variant", ["dense", "qwen3"])
def test_an_eos_token_id_list_keeps_its_first_as_the_end_of_document(exports, variant, tmp_path,
                                                                      caplog):
    """Llama 3.1 Instruct's config.json lists its end-of-text, end-of-message and end-of-turn ids.
    The first becomes data.eod_id with a warning naming the file; it was left unset without a
    word, so a second export's generate() never stopped."""
    source = tmp_path / "listed"
    shutil.copytree(exports.get(variant).hf_dir, source)
    config = json.loads((source / "config.json").read_text())
    config["eos_token_id"] = [3, 5]
    (source / "config.json").write_text(json.dumps(config))
    caplog.clear()  # the export's warnings (these runs' tokenizer size is unknown)
    assert import_hf(source, tmp_path / "back")["eod_id"] == 3
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(source / "config.json") in warning and "[3, 5]" in warning


def test_no_model_is_initialised(exports, tmp_path, monkeypatch):
    """The conversion writes every tensor of the model it builds, and the one that re-reads the
    saved checkpoint to check it loads every tensor: neither draws random weights (nor touches
    the memory it is about to overwrite)."""
    import megaloop.models.model as model_module

    exported = exports.get("dense")  # built (exported) first, if not yet
    build, initialised = model_module.build_model, []

    def recording(*args, initialize=True, **kwargs):
        initialised.append(initialize)
        return build(*args, initialize=initialize, **kwargs)

    monkeypatch.setattr(model_module, "build_model", recording)
    import_hf(exported.hf_dir, tmp_path / "back")
    assert initialised == [False, False]


@pytest.mark.parametrize("variant, dtype", [("asymloop", None), ("asymloop_tied_gqa1", None),
                                            ("latentloop_moe_untied_v3", None),
                                            ("qwen3", "bfloat16")])
def test_an_import_holds_one_copy_of_the_weights_at_a_time(exports, variant, dtype, tmp_path,
                                                           monkeypatch):
    """The Hugging Face model is gone before the megaloop model is built, that one is filled a
    layer at a time and is gone before the saved checkpoint is read back: the tensors alive at
    each step add up to about one fp32 copy of the weights (before: the Hugging Face tensors
    beside the megaloop model, an int64 index of every weight element and two more copies,
    5x and more)."""
    from megaloop.hf import from_hf
    from megaloop.models import export

    exported = exports.get(variant, dtype)
    fp32_bytes = fp32_weight_bytes(exported.cfg)
    mapped, invert_mapping = [], export.invert_mapping

    def recording(mapping, values, shapes):  # the Hugging Face tensors mapped at once
        mapped.append(sum(t.numel() * 4 for t in values.values()))
        return invert_mapping(mapping, values, shapes)

    monkeypatch.setattr(export, "invert_mapping", recording)
    peaks = StoragePeaks(monkeypatch, (from_hf, "probe_logits"),
                         (from_hf, "build_single_process_model"),
                         (from_hf, "save_weights_checkpoint"), (from_hf, "load_checkpoint_model"))
    import_hf(exported.hf_dir, tmp_path / "back")
    assert peaks.calls.count("load_checkpoint_model") == 1
    assert 0.9 < peaks.most() / fp32_bytes < 1.25, peaks.most() / fp32_bytes
    assert len(mapped) > 2 and max(mapped) < 0.5 * fp32_bytes, (mapped, fp32_bytes)


def _copy(exports, variant, tmp_path) -> Path:
    return Path(shutil.copytree(exports.get(variant).hf_dir, tmp_path / "hf"))


def _edit_config(directory: Path, **fields):
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


def _refused(directory, tmp_path, match):
    with pytest.raises(ConversionError, match=match) as error:
        import_hf(directory, tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("variant, field, value", [("asymloop", "ffn_hidden_size", 80),
                                                   ("dense", "intermediate_size", 80)])
def test_refuses_shapes_that_do_not_match_config_naming_the_tensor(exports, tmp_path, variant,
                                                                   field, value):
    directory = _copy(exports, variant, tmp_path)
    _edit_config(directory, **{field: value})
    _refused(directory, tmp_path, r"tensor \S+(gate|up|down)_proj.weight: shape \((96, 64|64, 96)\) "
                                  r"in the safetensors, config.json gives \((80, 64|64, 80)\) "
                                  r"\(and \d+ more\)")


def test_refuses_a_missing_tensor_naming_it(exports, tmp_path):
    directory = _copy(exports, "latentloop", tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["writeback.1"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    _refused(directory, tmp_path, r"tensor writeback.1: missing from the safetensors files")


def test_refuses_a_directory_without_safetensors_or_config(exports, tmp_path):
    directory = _copy(exports, "dense", tmp_path)
    (directory / "model.safetensors").unlink()
    _refused(directory, tmp_path, "no loadable safetensors weights")
    (directory / "config.json").unlink()
    _refused(directory, tmp_path, r"config.json: missing or unreadable")


def test_a_megaloop_checkpoint_given_to_import_names_to_hf(exports, tmp_path):
    """Before: only "config.json: missing or unreadable", for the other direction's input."""
    checkpoint = exports.get("dense").checkpoint
    for source in (checkpoint, checkpoint.parent):  # an iter_N directory, its run's directory
        with pytest.raises(ConversionError) as error:
            import_hf(source, tmp_path / "out")
        message = str(error.value)
        assert message.startswith(f"{source / 'config.json'}: missing or unreadable")
        assert message.endswith(": tools/convert_checkpoint.py to-hf converts that direction")
        assert "\n" not in message and not (tmp_path / "out").exists()
    with pytest.raises(ConversionError) as error:  # an empty directory: no such hint
        import_hf(tmp_path, tmp_path / "out")
    assert "to-hf" not in str(error.value)


@pytest.mark.parametrize("fields, match", [
    (dict(attention_bias=True), r"attention_bias=True: must be false"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu': must be 'silu'"),
    (dict(model_type="gpt2"), r"model_type='gpt2': megaloop imports megaloop, "),
])
def test_refuses_what_megaloop_does_not_compute_naming_the_field(exports, tmp_path, fields,
                                                                 match):
    directory = _copy(exports, "dense", tmp_path)
    _edit_config(directory, **fields)
    _refused(directory, tmp_path, match)


@pytest.mark.parametrize("variant, fields, match", [
    ("mixtral", dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1: must be 0"),
    ("qwen3_moe", dict(attention_dropout=0.1), r"attention_dropout=0.1: must be 0"),
    ("dense", dict(attention_dropout=0.1), r"attention_dropout=0.1: must be 0"),
])
def test_refuses_training_noise_megaloop_does_not_apply_naming_the_field(exports, tmp_path,
                                                                         variant, fields, match):
    """Dropout and router jitter act only in training, so the probe's eval-mode logits agree: the
    import passed, and fine-tuning it trained without them, unsaid."""
    directory = _copy(exports, variant, tmp_path)
    _edit_config(directory, **fields)
    _refused(directory, tmp_path, match)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_refuses_a_damaged_safetensors_file_naming_it(exports, tmp_path, damage):
    """One shard of a sharded directory (a native model saved in pieces), cut short or
    overwritten."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(exports.get("dense").hf_dir).save_pretrained(
        tmp_path / "hf", max_shard_size="100KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    if damage == "truncated":
        with open(shard, "r+b") as file:
            file.truncate(shard.stat().st_size // 2)
    else:
        shard.write_bytes(b"not safetensors")
    _refused(tmp_path / "hf", tmp_path, rf"^{shard}: not a readable safetensors file")


@pytest.mark.parametrize("variant, fields, match", [
    ("asymloop", dict(hidden_size="64"), r"config.json: hidden_size='64': must be of type int$"),
    ("asymloop", dict(injection="globalkv"), r"config.json: injection='globalkv': must be one of "),
    ("latentloop", dict(latent_visits=[1, "2"]), r"latent_visits\[1\]='2': must be of type int$"),
    ("asymloop", dict(iterations=None), r"config.json: iterations=None: megaloop reads this model "
                                        r"as iterations=3; write that$"),
])
def test_refuses_an_edited_megaloop_config_naming_the_field(exports, tmp_path, variant, fields,
                                                            match):
    """Without the check: a TypeError inside the model, or a message about tensors."""
    directory = _copy(exports, variant, tmp_path)
    _edit_config(directory, **fields)
    _refused(directory, tmp_path, match)


@pytest.mark.parametrize("variant", ["dense", "asymloop"])
def test_refuses_an_untied_output_layer_under_tie_word_embeddings(exports, tmp_path, variant):
    """transformers loads the stored lm_head.weight all the same; megaloop would tie it (before:
    a probe mismatch, exit 1, as if the conversion were wrong)."""
    directory = _copy(exports, variant, tmp_path)
    _edit_config(directory, tie_word_embeddings=True)
    _refused(directory, tmp_path, r"tensor lm_head.weight: differs from the embedding, which "
                                  r"config.json's tie_word_embeddings=true makes it")


def test_the_megaloop_model_types_are_those_of_the_reference_configs():
    """One list (read by the import and by the evaluation's depth setting) of the model_type
    values an export's config.json carries."""
    from megaloop.hf.from_hf import MEGALOOP_MODEL_TYPES
    from megaloop.reference.configuration_megaloop import LatentLoopConfig, MegaloopConfig

    assert sorted(MEGALOOP_MODEL_TYPES) == sorted([MegaloopConfig.model_type,
                                                   LatentLoopConfig.model_type])
