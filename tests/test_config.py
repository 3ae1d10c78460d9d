"""Typed configs: YAML round trip, dotted overrides and one-line validation errors."""

import pytest

from megaloop.config import (ConfigError, ModelConfig, ParallelConfig, RunConfig, apply_overrides,
                             load_yaml, save_yaml, split_weights)


def test_yaml_round_trip_preserves_every_field(tmp_path):
    cfg = apply_overrides(RunConfig(), ["model.arch=fullloop", "model.iterations=2",
                                        "model.block=olmo", "train.lr=3e-4",
                                        "parallel.tensor=2", "model.num_query_groups=2"])
    path = tmp_path / "run.yaml"
    save_yaml(cfg, path)
    assert load_yaml(path) == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"], "no temporary file left behind"
    # Text the loader refuses unquoted (YAML 1.1 booleans and integers) is written quoted.
    for text in ("n", "Y", "yes", "off", "0123", "1_000"):
        cfg.train.wandb_project = text
        save_yaml(cfg, path)
        assert load_yaml(path).train.wandb_project == text  # before: 'n' came back refused


def test_dotted_overrides_are_typed():
    cfg = apply_overrides(RunConfig(), ["train.lr=1", "model.qk_norm=false",
                                        "model.encoder_layers=null"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.model.qk_norm is False and cfg.model.encoder_layers is None


@pytest.mark.parametrize("overrides, message", [
    (["model.hiden_size=64"], "unknown field model.hiden_size (did you mean hidden_size?)"),
    (["model.arch=loop"], "model.arch='loop': must be one of 'dense', 'fullloop', 'asymloop'"),
    (["model.iterations=three"], "model.iterations='three': must be of type int"),
    (["model.iterations=true"], "model.iterations=True: must be of type int"),
    (["modelhidden_size"], "expected the form section.field=value"),
    (["model.hidden_size.x=1"], "model.hidden_size is not a section"),
    (["trian.lr=1e-4"], "override 'trian.lr=1e-4': trian is not a section (did you mean train?)"),
    (["train.downstream.tasks=[a]"], "train.downstream is not a section (did you mean "
                                     "downstream_eval?)"),
    # Before: "data.sft_solution={'answer': None}: must be of type str", a mapping never written.
    (["data.sft_solution={answer}"], "data.sft_solution={'answer': None}: must be text; YAML "
                                     "reads an unquoted {...} as a mapping: write the value in "
                                     'quotes ("{...}")'),
])
def test_bad_overrides_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, message", [
    (dict(arch="asymloop", num_layers=4, encoder_layers=4),
     "model.encoder_layers=4: must be in [1, 3] so that E + D = num_layers=4"),
    (dict(arch="asymloop", iterations=0), "model.iterations=0: must be >= 1"),
    (dict(arch="dense", iterations=2), "model.iterations=2: must be 1 for arch=dense"),
    (dict(hidden_size=130, num_attention_heads=4), "model.hidden_size=130: must be a multiple"),
    (dict(num_attention_heads=4, num_query_groups=3), "model.num_query_groups=3: must be a divisor"),
    (dict(arch="asymloop", injection="none", local_kv=False), "model.local_kv=False"),
    (dict(arch="fullloop", iterations=2, injection="additive"), "model.injection='additive'"),
])
def test_model_validation_errors_are_one_line(fields, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**fields).validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_parallel_validation_checks_divisibility():
    model = ModelConfig(num_attention_heads=4, num_query_groups=2).resolve()
    with pytest.raises(ConfigError, match=r"parallel.tensor=4: must be a divisor of "
                                          r"model.num_query_groups=2"):
        ParallelConfig(tensor=4).validate(model)
    ParallelConfig(tensor=2).validate(model)


def test_list_fields_are_typed_and_a_single_value_becomes_a_list():
    cfg = apply_overrides(RunConfig(), ["train.eval_depths=3", "data.path=/data/fwe_text_document"])
    assert cfg.train.eval_depths == [3] and cfg.data.path == ["/data/fwe_text_document"]
    blend = apply_overrides(RunConfig(), ["data.path=[0.7, /a, 0.3, /b]"]).data.path
    assert blend == ["0.7", "/a", "0.3", "/b"]
    with pytest.raises(ConfigError, match=r"train.eval_depths\[1\]='a': must be of type int"):
        apply_overrides(RunConfig(), ["train.eval_depths=[1, a]"])
    with pytest.raises(ConfigError, match="override 'train.lr=\\[': the value is not valid YAML"):
        apply_overrides(RunConfig(), ["train.lr=["])


@pytest.mark.parametrize("field", ["checkpoint.dir", "checkpoint.load", "data.cache_dir",
                                   "train.wandb_project", "train.fp8_recipe"])
def test_an_empty_value_for_an_optional_field_is_refused(field):
    # Before: "data.cache_dir=" gave megatron-core's index cache the path "" while the token-id
    # check used the default; checkpoint.dir="" meant the default there.
    with pytest.raises(ConfigError, match=rf"^{field}='': must not be empty; "
                                          "null leaves it unset$"):
        apply_overrides(RunConfig(), [f"{field}="])
    assert apply_overrides(RunConfig(), [f"{field}=null"]) == RunConfig()


def test_a_single_string_for_a_tuple_field_is_one_item_not_its_characters(tmp_path):
    # Before: alrs.exclude: router became ('r', 'o', 'u', 't', 'e', 'r'), excluding every matrix
    # whose name holds one of those letters; items were not type-checked.
    config = tmp_path / "run.yaml"
    config.write_text("alrs:\n  exclude: router\n  embedding_head_prefixes: embedding.\n")
    alrs = load_yaml(config).alrs
    assert alrs.exclude == ("router",) and alrs.embedding_head_prefixes == ("embedding.",)
    assert apply_overrides(RunConfig(), ["alrs.exclude=[router, 7]"]).alrs.exclude == (
        "router", "7")
    with pytest.raises(ConfigError, match=r"alrs.exclude\[0\]=\[1\]: must be of type str"):
        apply_overrides(RunConfig(), ["alrs.exclude=[[1]]"])


@pytest.mark.parametrize("field", ["train.eval_depths", "alrs.exclude", "data.path"])
def test_null_for_a_list_field_is_refused_as_null(field):
    """null (or ~) meant as "none" for a list. Before: "train.eval_depths[0]=None: must be of
    type int", as if the user had written a list holding null."""
    with pytest.raises(ConfigError) as error:
        apply_overrides(RunConfig(), [f"{field}=null"])
    assert str(error.value) == f"{field}=None: must be a list ([] for none)"


@pytest.mark.parametrize("fields, message", [
    (dict(expert=2), "parallel.expert=2: must be 1 unless model.num_experts > 0"),
    (dict(sequence_parallel=True), "parallel.sequence_parallel=True: must be false unless tensor"),
    (dict(pipeline=32), "parallel.pipeline=32: must be such that pipeline x virtual_pipeline = "
                        "32 stages get at least one of the model's 8 layer applications each"),
    (dict(virtual_pipeline=2), "parallel.virtual_pipeline=2: must be 1 unless parallel.pipeline"),
    (dict(distributed_timeout_minutes=10**14), "timeout_minutes=100000000000000: must be <= 1000"),
    (dict(pipeline_split=[8]), "parallel.pipeline_split=[8]: must be empty unless "
                               "parallel.pipeline > 1"),
])
def test_parallel_mistakes(fields, message):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**fields).validate(ModelConfig(arch="asymloop").resolve())
    assert message in str(err.value)


def test_pipelines_unroll_every_architecture_but_latentloop():
    ParallelConfig(pipeline=4).validate(ModelConfig(arch="asymloop").resolve())
    ParallelConfig(pipeline=3).validate(ModelConfig(arch="dense", num_layers=8).resolve())
    ParallelConfig(pipeline=2, virtual_pipeline=2).validate(ModelConfig(arch="fullloop").resolve())
    with pytest.raises(ConfigError, match="parallel.pipeline=2: must be 1 for model.arch="
                                          "latentloop"):
        ParallelConfig(pipeline=2).validate(ModelConfig(arch="latentloop").resolve())


def test_derived_defaults():
    asym = ModelConfig(arch="asymloop", num_layers=6, iterations=3).resolve()
    assert (asym.num_encoder_layers, asym.num_decoder_layers, asym.effective_depth) == (3, 3, 12)
    assert asym.qk_norm is True
    full = ModelConfig(arch="fullloop", num_layers=6, iterations=2).resolve()
    assert (full.num_encoder_layers, full.effective_depth, full.qk_norm) == (0, 12, False)
    # Iterations default per architecture to the paper's matched depth J = 2L (dense: 1).
    assert [ModelConfig(arch=a, num_layers=6).resolve().effective_depth
            for a in ("dense", "fullloop", "asymloop")] == [6, 12, 12]


def test_yaml_file_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_yaml(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(bad)
    # Before: IsADirectoryError and UnicodeDecodeError tracebacks.
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path}: cannot be read \(Is a "
                                          r"directory\)$"):
        load_yaml(tmp_path)
    bad.write_bytes(b"model:\n  arch: dense # \xe9t\xe9\n")  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=rf"^config file {bad}: not UTF-8 text \(byte 0xe9 on "
                                          r"line 2\)$"):
        load_yaml(bad)


@pytest.mark.parametrize("split, weights", [
    ("969,30,1", [969, 30, 1]), ("90/10", [90, 10, 0]), ("100", [100, 0, 0]),
    (" 0.9, 0.1 ,0 ", [0.9, 0.1, 0]),
    ("90;10", None), ("-1,2", None), ("0,1,0", None), ("1,2,3,4", None), ("abc", None),
    ("", None), ("nan,1", None), ("1" * 400, None),  # inf: megatron-core's shares NaN
    # Read by float(), but megatron-core reads the digits alone: "1e2" as 1,2 (a third trained),
    # "1_000,1" as 1,0,1, "9.9e1,1" as 9.9,1,1; before, accepted and so trained.
    ("1e2", None), ("1_000,1", None), ("9.9e1,1", None),
])
def test_split_strings(split, weights):
    assert split_weights(split) == weights


@pytest.mark.parametrize("overrides, message", [
    (["train.out_dir=' '"], "train.out_dir=' ': must be a directory path"),
    (["data.tokenizer_type=tiktoken"], "data.tokenizer_type='tiktoken': must be one of"),
    # Before: accepted, and read by nobody (a fresh optimizer without a checkpoint to load).
    (["checkpoint.load_optimizer=false"], "checkpoint.load_optimizer=False: must be left at true "
     "unless checkpoint.load is given"),
    # Before: accepted, and read by nobody (no tokenizer is loaded with data.eod_id alone).
    (["data.tokenizer_type=HuggingFaceTokenizer"], "data.tokenizer_type='HuggingFaceTokenizer': "
     "must be left at its default 'SentencePieceTokenizer' unless data.tokenizer_model is given"),
    # Before the field: legacy data trained with another EOD id than its own; without a
    # tokenizer the flag would be read by nobody.
    (["data.legacy_tokenizer=true"], "data.legacy_tokenizer=True: must be false unless "
     "data.tokenizer_model is given"),
    (["data.split=1,2,3,4"], "data.split='1,2,3,4': must be up to three non-negative decimal "
     "numbers"),
    (["model.arch=dense", "model.iterations=1", "train.eval_depths=[2]"],
     "train.eval_depths=[2]: must be empty for model.arch=dense"),
    # Before the fix, refused by the final evaluation, after the last step and before its save.
    (["model.arch=latentloop", "model.encoder_layers=null", "train.eval_depths=[2, 3]"],
     "train.eval_depths=[2, 3]: must be depths the model runs (3: arch=latentloop runs exactly "
     "its iterations=2 visits (each has its own scales))"),
    (["parallel.pipeline=2", "train.eval_depths=[2]"],
     "train.eval_depths=[2]: must be empty when parallel.pipeline > 1 (the stages unroll "
     "exactly model.iterations iterations)"),
    (["alrs.s2=3"], "train.use_alrs=False: must be true when alrs.s2=3.0 is set (the alrs "
                    "section is read only with ALRS on)"),
    # Before: accepted here (and by --dry-run), refused only once the run had started.
    (["data.path=[-1, /x]"], "data.path=['-1', '/x']: data blend: weight '-1' of '/x' is not a "
                             "finite positive number"),
    # Before: a zero weight beside others was megatron-core's bare AssertionError at start-up.
    (["data.path=[1, /x, 0, /y]"], "data.path=['1', '/x', '0', '/y']: data blend: weight '0' of "
                                   "'/y' is not a finite positive number (to leave a dataset out, "
                                   "drop it from the blend)"),
    # Before: taken as two datasets, drawing from /x twice as often without a word.
    (["data.path=[/x, /d/../x]"], "data.path=['/x', '/d/../x']: data blend: '/d/../x' is given "
                                  "twice (as '/x' and '/d/../x'), which draws from it twice as "
                                  "often; give it once, with weights for a larger share"),
    # Before: tracebacks from torch or numpy once the model was built, NaN steps (rotary_base),
    # or no clipping and growing weights without a word (negative clip_grad, weight_decay).
    (["train.adam_beta2=1"], "train.adam_beta2=1.0: must be in [0, 1)"),
    (["train.seed=-1"], "train.seed=-1: must be in [0, 2**32 - 1]"),
    (["train.clip_grad=-1"], "train.clip_grad=-1.0: must be >= 0 (0: no clipping)"),
    (["train.weight_decay=-0.1"], "train.weight_decay=-0.1: must be >= 0"),
    (["model.init_std=-1"], "model.init_std=-1.0: must be > 0"),
    (["model.rotary_base=0"], "model.rotary_base=0.0: must be > 0"),
    # Before: accepted, and nothing changed (the two modes encode this type alike).
    (["data.tokenizer_model=t", "data.eod_id=null", "data.path=[x]",
      "data.tokenizer_type=GPTSentencePieceTokenizer", "data.legacy_tokenizer=true"],
     "data.legacy_tokenizer=True: must be false with data.tokenizer_type="
     "'GPTSentencePieceTokenizer', which Megatron-LM's legacy and new tokenizers encode alike (it "
     "changes SentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer)"),
    # Before: depth 2 evaluated and logged twice at every evaluation.
    (["train.eval_depths=[2, 2]"], "train.eval_depths=[2, 2]: must be a list of distinct "
                                   "iteration counts >= 1"),
    # Before: a ValueError traceback from the monitor once the model was built.
    (["train.peak_tflops=0"], "train.peak_tflops=0.0: must be > 0, or null (a known GPU's own "
                              "peak; no MFU on CPU)"),
    (["data.path=[1, a.jsonl]", "data.format=sft", "data.eod_id=null", "data.tokenizer_model=t"],
     "data.path=['1', 'a.jsonl']: must be a list of .jsonl/.parquet files, used whole "
     "(data.format='sft' takes no blend weights)"),
    # Before: accepted, the run failing in set-up as ".idx: not found", no field named.
    (["data.path="], "data.path=['']: must be free of empty entries (an empty prefix or file "
                     "names no data)"),
    (["data.path=[x, '']"], "data.path=['x', '']: must be free of empty entries"),
])
def test_run_validation_errors_are_one_line(overrides, message):
    cfg = apply_overrides(RunConfig(), ["data.path=[x]", "data.eod_id=0", *overrides])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, head_dim", [
    (dict(hidden_size=48, num_attention_heads=4), 12),    # not a multiple of 8
    (dict(hidden_size=528, num_attention_heads=2), 264),  # above 256
])
def test_head_dims_the_cuda_flash_kernel_cannot_take_are_refused(fields, head_dim):
    with pytest.raises(ConfigError) as err:
        ModelConfig(arch="asymloop", **fields).validate()
    message = str(err.value)
    assert f"head dim (here {head_dim}) is a multiple of 8 and at most 256" in message
    assert "\n" not in message
    # The masked kernel and the plain attention roles have no such limit.
    ModelConfig(arch="asymloop", joint_attention="masked", **fields).validate()
    ModelConfig(arch="dense", iterations=1, **fields).validate()


def test_fp8_recipe_needs_fp8_precision_and_defaults_to_current_scaling():
    with pytest.raises(ConfigError, match=r"^train.fp8_recipe='delayed': must be unset unless "
                                          r"train.precision='fp8'$"):
        apply_overrides(RunConfig(), ["train.fp8_recipe=delayed"]).train.validate()
    assert apply_overrides(RunConfig(), ["train.precision=fp8"]).train.resolved_fp8_recipe == \
        "current"
    assert RunConfig().train.resolved_fp8_recipe is None
    with pytest.raises(ConfigError, match="must be one of 'current', 'delayed', 'mxfp8'"):
        apply_overrides(RunConfig(), ["train.fp8_recipe=hybrid"])


@pytest.mark.parametrize("overrides, message", [
    (["train.wsd_decay_fraction=0.3"],
     "train.wsd_decay_fraction=0.3: must be unset unless train.lr_schedule='wsd'"),
    (["train.lr_schedule=cosine", "train.wsd_decay_style=linear"],
     "train.wsd_decay_style='linear': must be unset unless train.lr_schedule='wsd'"),
    (["train.lr_schedule=wsd", "train.wsd_decay_fraction=0"],
     "train.wsd_decay_fraction=0.0: must be in (0, 1], for a decay that starts after the warmup"),
    (["train.lr_schedule=wsd", "train.wsd_decay_fraction=0.95"],
     "train.wsd_decay_fraction=0.95: must be in (0, 1], for a decay that starts after the warmup "
     "(here 95 decay + 10 warmup steps of train_steps=100)"),
    (["train.lr_schedule=wsd", "train.warmup_fraction=0.9"],  # with the default decay, 0.2
     "train.wsd_decay_fraction=0.2: must be in (0, 1]"),
])
def test_wsd_settings_are_refused_where_they_would_be_ignored_or_overlap_the_warmup(
        overrides, message):
    with pytest.raises(ConfigError) as error:
        apply_overrides(RunConfig(), overrides).train.validate()
    assert str(error.value).startswith(message)
    with pytest.raises(ConfigError, match="must be one of 'cosine', 'linear', 'wsd'"):
        apply_overrides(RunConfig(), ["train.lr_schedule=constant"])


@pytest.mark.parametrize("warmup, decay, decay_steps", [(0.07, 0.93, 93), (0.0, 0.29, 29),
                                                         (0.42, 0.58, 58), (0.1, None, 20)])
def test_wsd_decay_steps_are_the_fraction_of_the_steps_given(warmup, decay, decay_steps):
    """0.29 x 100 is 28.999999999999996 in floats: the decay had 28 steps, and a decay that ends
    where the warmup starts (0.07 + 0.93) was refused as overlapping it."""
    train = apply_overrides(RunConfig(), [
        "train.lr_schedule=wsd", f"train.warmup_fraction={warmup}",
        *([f"train.wsd_decay_fraction={decay}"] if decay is not None else [])]).train
    train.validate()
    assert train.wsd_decay_steps == decay_steps


@pytest.mark.parametrize("arch, iterations, refused", [
    ("asymloop", 3, True), ("fullloop", 2, True), ("asymloop", 1, False), ("dense", 1, False)])
def test_delayed_fp8_with_full_recompute_of_a_looped_block_is_refused(arch, iterations, refused):
    """Transformer Engine replays delayed-scaling state first in, first out during recompute;
    a weight-tied block recomputes its calls last to first."""
    cfg = apply_overrides(RunConfig(), [f"model.arch={arch}", f"model.iterations={iterations}",
                                        "train.precision=fp8", "train.fp8_recipe=delayed",
                                        "parallel.recompute=full", "data.path=[/d]",
                                        "data.eod_id=0"])
    if not refused:
        cfg.validate()
        return
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith("train.fp8_recipe='delayed': must be 'current' or 'mxfp8' "
                                     "with parallel.recompute=full and a looped model")
    for fix in (["train.fp8_recipe=current"], ["parallel.recompute=none"]):
        apply_overrides(cfg, fix).validate()


def test_head_dim_may_differ_from_hidden_over_heads_and_must_be_even():
    cfg = ModelConfig(hidden_size=130, num_attention_heads=4, head_dim=40).resolve()
    cfg.validate()
    assert cfg.kv_channels == 40
    with pytest.raises(ConfigError, match=r"model.head_dim=33: must be such that the head dim is "
                                          r"even"):
        ModelConfig(head_dim=33).validate()


@pytest.mark.parametrize("model, parallel, message", [
    (dict(num_attention_heads=32, ffn_hidden_size=5461, vocab_size=32128), dict(tensor=2),
     "parallel.tensor=2: must be a divisor of model.ffn_hidden_size=5461, "
     "model.decoder_ffn_hidden_size=5461 (tensor sizes that divide the heads, query groups, FFN "
     "widths and vocabulary: 1)"),
    (dict(num_attention_heads=8, ffn_hidden_size=512, vocab_size=1004), dict(tensor=8),
     "parallel.tensor=8: must be a divisor of model.vocab_size=1004 (tensor sizes that divide the "
     "heads, query groups, FFN widths and vocabulary: 1, 2, 4; or pad the vocabulary)"),
    (dict(seq_length=30), dict(tensor=4, sequence_parallel=True),
     "parallel.sequence_parallel=True: must be false, or parallel.tensor=4 a divisor of "
     "model.seq_length=30 (sequence parallelism splits the sequence over the tensor-parallel "
     "ranks; sizes that fit: 1, 2, 3, 5, 6, 10, 15, 30)"),
    (dict(arch="dense", num_layers=6, iterations=1), dict(pipeline=4, pipeline_split=[2, 2, 2, 1]),
     "parallel.pipeline_split=[2, 2, 2, 1]: must be 4 per-stage counts of layer applications, "
     "each >= 1, summing to 6 = num_layers 6; e.g. [1, 2, 2, 1] (balanced)"),
    (dict(arch="fullloop", iterations=2), dict(pipeline=2, pipeline_split=[1, 2, 3]),
     "parallel.pipeline_split=[1, 2, 3]: must be 2 per-stage counts of layer applications, "
     "each >= 1, summing to 8 = R 2 x L 4; e.g. [7, 1] (balanced)"),
    (dict(arch="asymloop", iterations=3), dict(pipeline=2, pipeline_split=[0, 8]),
     "parallel.pipeline_split=[0, 8]: must be 2 per-stage counts of layer applications, "
     "each >= 1, summing to 8 = E 2 + K 3 x D 2; e.g. [7, 1] (balanced)"),
])
def test_layouts_that_do_not_divide_the_model_say_what_would(model, parallel, message):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**parallel).validate(ModelConfig(**model).resolve())
    assert str(err.value) == message


def _float_fields():
    """``section.field`` of every float, optional float and list-of-floats field of a run."""
    import typing

    for section, cls in typing.get_type_hints(RunConfig).items():
        for name, hint in typing.get_type_hints(cls).items():
            if float in (hint, *typing.get_args(hint)):
                yield f"{section}.{name}", typing.get_origin(hint) is list


@pytest.mark.parametrize("value", [".inf", "-.inf", "nan"])
@pytest.mark.parametrize("key, is_list", list(_float_fields()))
def test_every_float_field_refuses_inf_and_nan(key, is_list, value):
    """A range check such as lr > 0 lets inf through (the run trained NaN and saved it)."""
    overrides = ["data.path=[x]", "data.eod_id=0",
                 f"{key}=[{value}]" if is_list else f"{key}={value}"]
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), overrides).validate()
    message = str(err.value)
    assert "\n" not in message
    # Before, ALRSConfig's range checks came first, worded "alrs: ALRS s1 must be > 0, got s1=nan".
    assert message.startswith(f"{key}=") and message.endswith(": must be finite (not inf or nan)")


def test_float_fields_list_covers_the_audited_ones():
    keys = {key for key, _ in _float_fields()}
    assert {"train.lr", "train.clip_grad", "train.peak_tflops", "model.rotary_base",
            "model.residual_scale_init", "alrs.s2"} <= keys


def test_a_model_validated_alone_refuses_non_finite_floats():
    with pytest.raises(ConfigError, match=r"^model.init_std=inf: must be finite"):
        ModelConfig(init_std=float("inf")).validate()


@pytest.mark.parametrize("overrides, message", [
    (["model.arch=dense", "model.encoder_layers=3"],
     "model.encoder_layers=3: must be left at its default None unless arch=asymloop"),
    (["model.arch=fullloop", "model.encoder_layers=1"],
     "model.encoder_layers=1: must be left at its default None unless arch=asymloop"),
    (["model.arch=latentloop", "model.encoder_layers=1"],
     "model.encoder_layers=1: must be left at its default None unless arch=asymloop"),
    (["model.arch=dense", "model.global_kv_norm=false"],
     "model.global_kv_norm=False: must be left at its default True unless arch=asymloop with "
     "injection='global_kv'"),
    (["model.injection=none", "model.global_kv_norm=false"], "model.global_kv_norm=False"),
    (["model.arch=fullloop", "model.joint_attention=masked"],
     "model.joint_attention='masked': must be left at its default 'fused' unless arch=asymloop "
     "with injection='global_kv' and local_kv=true"),
    (["model.local_kv=false", "model.joint_attention=masked"], "model.joint_attention='masked'"),
    (["model.arch=dense", "model.local_kv=false"],
     "model.local_kv=False: must be left at its default True unless arch=asymloop"),
    (["model.moe_top_k=4"], "model.moe_top_k=4: must be left at its default 2 unless "
                            "num_experts > 0"),
    (["model.moe_shared_expert_size=64"], "model.moe_shared_expert_size=64"),
    (["model.moe_layers=decoder"], "model.moe_layers='decoder'"),
    (["model.moe_ffn_hidden_size=64"], "model.moe_ffn_hidden_size=64"),
    (["model.moe_aux_loss_coeff=0.1"], "model.moe_aux_loss_coeff=0.1"),
    (["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.decoder_ffn_hidden_size=1024"],
     "model.decoder_ffn_hidden_size=1024: must be unset when the decoder's FFNs are MoE layers "
     "(moe_layers='all'), which use moe_ffn_hidden_size"),
    (["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_layers=decoder",
      "model.decoder_ffn_hidden_size=1024"], "model.decoder_ffn_hidden_size=1024"),
])
def test_model_fields_the_architecture_ignores_are_refused(overrides, message):
    cfg = apply_overrides(RunConfig(), ["data.path=[x]", "data.eod_id=0", *overrides])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["model.global_kv_norm=false", "model.joint_attention=masked", "model.encoder_layers=1"],
    ["model.num_experts=8", "model.moe_top_k=4", "model.moe_shared_expert_size=64",
     "model.moe_layers=decoder", "model.moe_ffn_hidden_size=64", "model.moe_aux_loss_coeff=0.1"],
    ["model.arch=fullloop", "model.num_experts=4", "model.moe_top_k=3"],
    ["model.arch=latentloop", "model.num_experts=4", "model.moe_top_k=3", "model.prelude_layers=1"],
    ["model.arch=dense"],
])
def test_saved_configs_validate_again_as_a_resume_reads_them(tmp_path, overrides):
    """A checkpoint's config.yaml holds every field, resolved: it must validate as it was saved."""
    cfg = apply_overrides(RunConfig(), ["data.path=[x]", "data.eod_id=0", *overrides]).validate()
    save_yaml(cfg, tmp_path / "config.yaml")
    assert load_yaml(tmp_path / "config.yaml").validate() == cfg


def test_alrs_granularity_is_read_without_alrs_too():
    """It shapes the optimizer's per-block LR multipliers, which work without ALRS."""
    apply_overrides(RunConfig(), ["data.path=[x]", "data.eod_id=0",
                                  "alrs.granularity=parameter"]).validate()


def test_a_wider_decoder_ffn_is_kept_where_the_decoder_is_dense():
    """moe_layers=encoder leaves the decoder's FFNs dense: their width is read."""
    cfg = apply_overrides(RunConfig(), ["data.path=[x]", "data.eod_id=0", "model.num_experts=4",
                                        "model.moe_ffn_hidden_size=64", "model.moe_layers=encoder",
                                        "model.decoder_ffn_hidden_size=1024"]).validate()
    assert cfg.model.decoder_ffn_hidden_size == 1024


@pytest.mark.parametrize("overrides, message", [
    (["model.num_experts=4", "model.moe_top_k=1"],
     "model.moe_top_k=1: must be in [2, num_experts=4] (top-1 routing would give the router no "
     "gradient)"),
    (["model.num_experts=4", "model.moe_top_k=5"], "model.moe_top_k=5: must be in [2, "),
    # Was a ZeroDivisionError traceback: the expert width FFN / k was derived before the check.
    (["model.num_experts=4", "model.moe_top_k=0"], "model.moe_top_k=0: must be in [2, "),
    (["model.num_experts=4", "model.moe_shared_expert_size=51", "parallel.tensor=2"],
     "parallel.tensor=2: must be a divisor of model.moe_shared_expert_size=51"),
])
def test_moe_settings_megatron_core_would_refuse_at_build_are_refused_naming_the_field(
        overrides, message):
    cfg = apply_overrides(RunConfig(), ["data.path=[x]", "data.eod_id=0", *overrides])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("arch, iterations, depth, refusal", [
    ("dense", None, 1, None), ("dense", None, 2, "arch=dense has no depth to vary"),
    ("latentloop", 2, 2, None), ("latentloop", None, 2, None),  # its default is 2 visits
    ("latentloop", 2, 3, "arch=latentloop runs exactly its iterations=2 visits"),
    ("asymloop", 3, 7, None), ("fullloop", 2, 1, None), ("asymloop", 3, 0, "must be >= 1"),
    ("dense", None, 0, "must be >= 1"),
])
def test_depth_refusal_is_the_one_test_time_depth_rule(arch, iterations, depth, refusal):
    problem = ModelConfig(arch=arch, iterations=iterations).depth_refusal(depth)
    assert problem == refusal if refusal is None else problem.startswith(refusal)


def test_a_config_is_checked_without_loading_numpy_torch_or_the_data_pipeline():
    """A typo in a config or override is answered at once: before, megaloop.config loaded numpy
    and the dataset code (0.3 s of its 0.4 s), for the two string rules of data.path and
    data.split (megaloop.data.blend)."""
    import subprocess
    import sys
    from pathlib import Path

    heavy = ("numpy", "torch", "megatron", "megaloop.data.datasets")
    overrides = ["data.path=[a]", "data.eod_id=0", "data.split=1,x"]
    code = ("import sys; from megaloop.config import ConfigError, RunConfig, apply_overrides\n"
            f"try:\n    apply_overrides(RunConfig(), {overrides!r}).validate()\n"
            "except ConfigError as e:\n    print(e)\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=60)
    assert done.stdout.splitlines()[-1] == "[]", done.stdout + done.stderr
    assert done.stdout.startswith("data.split='1,x': must be up to three"), done.stdout
