"""Config files as YAML reads them: duplicate keys, values YAML 1.1 and 1.2 read differently,
and numbers where text is expected (megaloop.config.serialization)."""

import pytest

from megaloop.config import ConfigError, RunConfig, apply_overrides, load_yaml, save_yaml


def test_duplicate_yaml_keys_are_refused_naming_file_key_and_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  arch: dense\n  num_layers: 4\n  arch: fullloop\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(path)
    assert str(err.value) == (f"config file {path}: key 'arch' given twice in one mapping, on "
                              "lines 2 and 4")
    path.write_text("model: {arch: dense}\ntrain: {lr: 0.1}\nmodel: {num_layers: 2}\n")
    with pytest.raises(ConfigError, match="key 'model' given twice in one mapping, on lines 1 "
                                          "and 3"):
        load_yaml(path)
    # The same key in different mappings, and a key a merge brought in, may be set; tags stay safe.
    path.write_text("model: {arch: dense, iterations: 1}\ntrain: {iterations: 2}\n"
                    "data: {<<: {split: '9,1', path: [a]}, split: '8,2'}\n")
    with pytest.raises(ConfigError, match="unknown field train.iterations"):
        load_yaml(path)
    path.write_text("model: {arch: dense, iterations: 1}\n"
                    "data: {<<: {split: '9,1', path: [a]}, split: '8,2'}\n")
    cfg = load_yaml(path)
    assert (cfg.model.arch, cfg.data.split, cfg.data.path) == ("dense", "8,2", ["a"])
    path.write_text("model: !!python/object/apply:os.system [echo]\n")
    with pytest.raises(ConfigError, match=r"invalid YAML \(could not determine a constructor"):
        load_yaml(path)
    with pytest.raises(ConfigError, match=r"override 'model=\{arch: dense, arch: fullloop\}': "
                                          "key 'arch' given twice"):
        apply_overrides(RunConfig(), ["model={arch: dense, arch: fullloop}"])


@pytest.mark.parametrize("yaml_text, override, message", [
    # Before the fix: seed 83, silently.
    ("train: {seed: 0123}", "train.seed=0123", "train.seed=0123: YAML 1.1 reads a leading zero "
     "as octal (83), YAML 1.2 as decimal (123); write the number without it"),
    ("train: {lr: 010}", "train.lr=010", "train.lr=010: YAML 1.1 reads a leading zero as octal "
     "(8), YAML 1.2 as decimal (10); write the number without it"),
    ("train: {eval_depths: [1, 0_12]}", "train.eval_depths=[1, 0_12]", "train.eval_depths[1]=0_12:"
     " YAML 1.1 reads a leading zero as octal (10), YAML 1.2 as decimal (12); write the number "
     "without it"),
    ("train: {seed: 1:30}", "train.seed=1:30", "train.seed=1:30: YAML 1.1 reads this as base 60 "
     "(90), YAML 1.2 as text; write the number"),
    # Before the fix: qk_norm silently false, and a prompt or a path 'n' taken as written.
    ("model: {qk_norm: no}", "model.qk_norm=no", "model.qk_norm=no: YAML 1.1 reads this as "
     "false, YAML 1.2 as the text 'no'; write false for the boolean, or quote the text"),
    ("data: {sft_prompt: n}", "data.sft_prompt=n", "data.sft_prompt=n: YAML 1.1 reads this as "
     "false, YAML 1.2 as the text 'n'; write false for the boolean, or quote the text"),
    ("data: {path: [a, ON]}", "data.path=[a, ON]", "data.path[1]=ON: YAML 1.1 reads this as true,"
     " YAML 1.2 as the text 'ON'; write true for the boolean, or quote the text"),
    ("train: {seed: Y}", "train.seed=Y", "train.seed=Y: YAML 1.1 reads this as true, YAML 1.2 as "
     "the text 'Y'; write true for the boolean, or quote the text"),
])
def test_values_yaml_1_1_and_1_2_read_differently_are_refused_naming_field_and_fix(
        tmp_path, yaml_text, override, message):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(path)
    assert str(err.value) == f"config file {path}: {message}"
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), [override])
    assert str(err.value) == message


def test_true_false_and_quoted_yes_no_are_read_as_written(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {qk_norm: False}\ndata: {sft_prompt: 'yes', path: ['n', \"off\"]}\n")
    cfg = load_yaml(path)
    assert (cfg.model.qk_norm, cfg.data.sft_prompt, cfg.data.path) == (False, "yes", ["n", "off"])
    assert apply_overrides(cfg, ["model.qk_norm=TRUE"]).model.qk_norm is True


def test_numbers_where_text_is_expected_are_read_as_their_text(tmp_path):
    path = tmp_path / "run.yaml"
    # Before the fix: data.split=100: must be of type str.
    path.write_text("data: {split: 100, path: [0.3, a, 7, b], eod_id: 0}\n"
                    "train: {wandb_project: 2024, seed: 07}\ncheckpoint: {dir: 0123}\n")
    cfg = load_yaml(path).validate()
    assert (cfg.data.split, cfg.data.path) == ("100", ["0.3", "a", "7", "b"])
    assert (cfg.train.wandb_project, cfg.checkpoint.dir) == ("2024", "0123")  # as written
    assert cfg.train.seed == 7  # 07 is 7 in either reading
    assert apply_overrides(RunConfig(), ["data.split=100"]).data.split == "100"
    save_yaml(cfg, path)
    assert load_yaml(path) == cfg
