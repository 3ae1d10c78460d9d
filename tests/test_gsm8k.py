"""GSM8K: answer normalisation and extraction rules, the fine-tuning recipe, and the whole path on
a tiny model (fine-tune a checkpoint on real GSM8K records, save, greedy-decode test questions with
the KV cache and without it, score, write predictions) through the two tools."""

import json
from pathlib import Path

import pytest

from megaloop import gsm8k
from megaloop.data import DataError
from tests.data.conftest import HF_TOKENIZER, SHARED_DATA, SP_MODEL
from tests.tool_scripts import load_tool

GSM8K_TRAIN = SHARED_DATA / "gsm8k_train.jsonl"
GSM8K_TEST = SHARED_DATA / "eval" / "gsm8k_test.jsonl"


@pytest.mark.parametrize("text, number", [
    ("1,234", "1234"), ("$1234.00", "1234"), ("1234.", "1234"), ("It is 1234.", "1234"),
    ("-7", "-7"), ("\u22127", "-7"), ("-$5", "-5"), ("$-5", "-5"), ("0.50", "0.5"),
    ("3.25 kg", "3.25"), ("12,345,678", "12345678"), ("-0", "0"), ("$ 5", "5"),
    ("1,23", "1"), ("x2 then 9", "9"), ("10-5", "10"), ("no number", None), ("", None),
])
def test_normalize_answer(text, number):
    assert gsm8k.normalize_answer(text) == number


@pytest.mark.parametrize("generation, answer, rule", [
    ("3 + 4 = <<3+4=7>>7 apples\n#### 7", "7", "####"),
    ("so 1,000 + 234\n#### $1,234.00\nQuestion: then 99", "1234", "####"),
    ("#### 5 #### 6", "5", "####"),
    ("He pays 2 * 9 = 18 dollars.", "18", "last number"),  # missing ####: the last number
    ("####", None, "####"),
    ("#### none", None, "####"),
    ("nothing numeric", None, None),
])
def test_extract_answer(generation, answer, rule):
    assert gsm8k.extract_answer(generation) == (answer, rule)


def test_reference_and_equality():
    assert gsm8k.reference_answer("6 * 3 = <<6*3=18>>18\n#### 18") == "18"
    assert gsm8k.reference_answer("The answer is 18") is None
    assert gsm8k.same_number("18", "18.0") and not gsm8k.same_number("18", "18.5")
    assert not gsm8k.same_number(None, "18")


def _save_tiny(directory: Path, data: dict | None = None, step: int = 0, **fields) -> None:
    """A tiny model's checkpoint at ``step`` in ``directory`` (keep_last=1: the one before goes)."""
    import megaloop.api as ml
    from megaloop.config import DataConfig, RunConfig
    from megaloop.training.checkpoint import save_checkpoint

    model = ml.build("tiny", hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, **fields)
    base = RunConfig(model=model.cfg, data=DataConfig(
        path=["x"], **(data or {"tokenizer_model": "tok.model"})))
    save_checkpoint(directory, step, {"model": model.sharded_state_dict()}, base, 1)


@pytest.fixture(scope="module")
def base_checkpoint(mcore, tmp_path_factory) -> Path:
    """A tiny model's checkpoint whose config names a tokenizer file that does not exist."""
    directory = tmp_path_factory.mktemp("base") / "checkpoints"
    _save_tiny(directory)
    return directory


def test_recipe_is_the_papers_and_overridable(base_checkpoint, tmp_path):
    cfg = gsm8k.finetune_config(base_checkpoint, ["train.jsonl"], str(tmp_path / "out"))
    assert (cfg.train.lr, cfg.train.global_batch_size, cfg.train.warmup_fraction,
            cfg.train.min_lr_ratio) == (1e-4, 32, 0.1, 0.0)
    assert (cfg.model.seq_length, cfg.data.split, cfg.data.format) == (1024, "6973,500,0", "sft")
    assert cfg.checkpoint.load == str(base_checkpoint / "iter_0000000")
    assert not cfg.checkpoint.load_optimizer
    assert cfg.data.tokenizer_model == "tok.model" and cfg.model.hidden_size == 32
    tuned = gsm8k.finetune_config(base_checkpoint, ["train.jsonl"], str(tmp_path / "out"),
                                  ["train.lr=3e-5", "model.seq_length=512"])
    assert (tuned.train.lr, tuned.model.seq_length) == (3e-5, 512)


def _flat(cfg) -> dict:
    from megaloop.config import to_dict

    return {f"{section}.{name}": value for section, fields in to_dict(cfg).items()
            for name, value in fields.items()}


def test_every_field_an_option_sets_is_refused_as_an_override_naming_it(base_checkpoint,
                                                                        tmp_path):
    """Runs that differ in one option only: each field in which their configs differ is one whose
    override the tool refuses, naming that option (the override would lose to it silently)."""
    import shutil

    from megaloop.cli import refuse_overrides_of
    from megaloop.config import ConfigError

    other_base = tmp_path / "other" / "checkpoints"
    shutil.copytree(base_checkpoint, other_base)
    arguments = {"--base": base_checkpoint, "--data": ["a.jsonl"], "--out": str(tmp_path / "a")}
    others = {"--base": other_base, "--data": ["b.jsonl"], "--out": str(tmp_path / "b")}
    first = _flat(gsm8k.finetune_config(*arguments.values()))
    set_by = load_tool("finetune_gsm8k").set_by_options()
    for option, value in others.items():
        changed = _flat(gsm8k.finetune_config(*{**arguments, option: value}.values()))
        keys = [key for key in first if first[key] != changed[key]]
        assert keys, option
        for key in keys:
            with pytest.raises(ConfigError, match=rf"^override '{key}=x': set by {option}$"):
                refuse_overrides_of([f"{key}=x"], set_by)


def test_tools_refuse_bad_input_in_one_line(base_checkpoint, tmp_path, capsys):
    finetune, evaluate = load_tool("finetune_gsm8k").main, load_tool("eval_gsm8k").main
    common = ["--base", str(base_checkpoint), "--data", "train.jsonl", "--out", str(tmp_path)]
    cases = [
        (finetune, common + ["--epochs", "1", "train.train_steps=5"],
         "--epochs and train.train_steps both set the run's length"),
        # An override right after --data's file is an override (it was taken for a data file).
        (finetune, common[:4] + ["train.train_steps=5"] + common[4:] + ["--epochs", "1"],
         "--epochs and train.train_steps both set the run's length"),
        (finetune, common, "data.tokenizer_model='tok.model': tok.model: tokenizer file not found"),
        # Before: "trian.lr=1e-5: input not found", as a data file.
        (finetune, common[:4] + ["trian.lr=1e-5"] + common[4:],
         "error: override 'trian.lr=1e-5': trian is not a section (did you mean train?)\n"),
        # Before: the override won silently (--base's model, another checkpoint's weights).
        (finetune, common + ["checkpoint.load=/other/iter_0000100"],
         "error: override 'checkpoint.load=/other/iter_0000100': set by --base\n"),
        (finetune, common + ["train.out_dir=/elsewhere"],
         "error: override 'train.out_dir=/elsewhere': set by --out\n"),
        (finetune, common + ["--epochs", "0", "data.tokenizer_model=null"],
         "data.tokenizer_model=None: must be given for data.format='sft'"),
        (evaluate, [str(base_checkpoint), "--test", "t.jsonl", "--max-new-tokens", "8"],
         "tok.model: tokenizer file not found"),
        (evaluate, [str(tmp_path / "none"), "--test", "t.jsonl"], "none: no checkpoint there"),
        # Before the fix: a traceback after decoding every question.
        (evaluate, [str(base_checkpoint), "--test", "t.jsonl", "--predictions",
                    "/dev/null/p.jsonl"], "error: --predictions /dev/null/p.jsonl: cannot be "
                                          "written (/dev/null is not a writable directory)"),
        (evaluate, [str(base_checkpoint), "--test", "t.jsonl", "--predictions", str(tmp_path)],
         f"error: --predictions {tmp_path}: cannot be written (it is a directory)"),
    ]
    for main, argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    # Before the fix a Dense model was looped 5 times without a word.
    dense = tmp_path.parent / "dense" / "checkpoints"
    _save_tiny(dense, arch="dense", iterations=1)
    assert evaluate([str(dense), "--test", "t.jsonl", "--num-iterations", "5"]) == 2
    assert capsys.readouterr().err == (f"error: --num-iterations 5: {dense / 'iter_0000000'}: "
                                       "arch=dense has no depth to vary (it would loop its layers; "
                                       "arch=fullloop is the looped stack)\n")
    # Its own depth 1 passes the depth check (and fails later, at the missing tokenizer).
    assert evaluate([str(dense), "--test", "t.jsonl", "--num-iterations", "1",
                     "--max-new-tokens", "8"]) == 2
    assert "tok.model: tokenizer file not found" in capsys.readouterr().err
    # Before the fix a LatentLoop model failed at its first forward, after the tokenizer, the
    # test file and the model were read (here the missing tokenizer came first).
    latent = tmp_path.parent / "latent" / "checkpoints"
    _save_tiny(latent, arch="latentloop", iterations=2, num_layers=3)
    assert evaluate([str(latent), "--test", "t.jsonl", "--num-iterations", "3"]) == 2
    assert capsys.readouterr().err == (f"error: --num-iterations 3: {latent / 'iter_0000000'}: "
                                       "arch=latentloop runs exactly its iterations=2 visits "
                                       "(each has its own scales)\n")
    with pytest.raises(SystemExit) as exit_:
        evaluate([str(base_checkpoint), "--test", "t.jsonl", "--limit", "0"])
    assert exit_.value.code == 2
    assert not list(tmp_path.iterdir())  # nothing written by a refused run


def _sentencepiece(path: Path, words: tuple[str, ...]) -> Path:
    from megaloop.data.tokenizer_training import train_sentencepiece

    train_sentencepiece([f"the {w} sat on {n} mats, said {w.upper()}!\n" for w in words
                         for n in range(40)], path, vocab_size=400, hard_vocab_limit=False)
    return path


def _run_with_tokenizer(tmp_path: Path) -> tuple[Path, list[str]]:
    """(the run's tokenizer, eval_gsm8k's arguments for one question) of a tiny model (vocab_size
    512, seq_length 128) whose run names a SentencePiece model trained here."""
    run_tokenizer = _sentencepiece(tmp_path / "run.model", ("cat", "dog", "emu"))
    base = tmp_path / "base" / "checkpoints"
    _save_tiny(base, data={"tokenizer_model": str(run_tokenizer)}, vocab_size=512)
    test_file = tmp_path / "t.jsonl"
    test_file.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    return run_tokenizer, [str(base), "--test", str(test_file), "--predictions",
                           str(tmp_path / "p.jsonl")]


def test_a_rerun_with_a_bad_latest_pointer_falls_back_as_the_trainer_would(base_checkpoint,
                                                                           tmp_path):
    """Before: the rerun's check read ``latest`` itself and refused a pointer to nothing even with
    checkpoint.fallback_to_previous=true, with which the trainer resumes from the previous
    checkpoint. The check decides alone: the trainer sets the damaged one aside."""
    import shutil

    from megaloop.training.checkpoint import CheckpointError

    own = tmp_path / "out" / "checkpoints"
    for step in (1, 2):
        shutil.copytree(base_checkpoint / "iter_0000000", own / f"iter_000000{step}")
    (own / "latest").write_text("iter_0000003\n")
    cfg = gsm8k.finetune_config(base_checkpoint, ["train.jsonl"], str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="fallback_to_previous=true resumes from iter_0000002"):
        gsm8k.resumed_config(cfg, base_checkpoint)
    cfg.checkpoint.fallback_to_previous = True
    assert gsm8k.resumed_config(cfg, base_checkpoint) is cfg
    assert (own / "latest").read_text() == "iter_0000003\n"
    assert sorted(p.name for p in own.iterdir()) == ["iter_0000001", "iter_0000002", "latest"]


def test_a_run_the_trainer_refuses_leaves_out_as_it_was(mcore, tmp_path, capsys):
    """Before: finetune.yaml (and --out) were written before the trainer's set-up, and stayed
    after it refused the run; a previous finetune.yaml there was replaced by the refused one."""
    _, argv = _run_with_tokenizer(tmp_path)
    finetune = load_tool("finetune_gsm8k").main
    refused = ["--base", argv[0], "--data", str(tmp_path / "missing.jsonl"),
               "train.train_steps=1"]  # the data is read first by the trainer's set-up
    out = tmp_path / "new" / "ft"
    assert finetune(refused + ["--out", str(out)]) == 2
    assert capsys.readouterr().err.endswith(f"error: {tmp_path / 'missing.jsonl'}: "
                                            "input not found\n")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "finetune.yaml").write_text("the user's\n")
    assert finetune(refused + ["--out", str(kept)]) == 2
    assert [p.name for p in kept.iterdir()] == ["finetune.yaml"]
    assert (kept / "finetune.yaml").read_text() == "the user's\n"


def test_a_tokenizer_other_than_the_runs_is_refused_before_decoding(mcore, tmp_path, capsys):
    """Before: another SentencePiece model gave an accuracy from ids the model never learned
    (exit 0), a larger vocabulary an IndexError at the embedding."""
    import shutil

    run_tokenizer, argv = _run_with_tokenizer(tmp_path)
    argv += ["--max-new-tokens", "2"]
    other = _sentencepiece(tmp_path / "other.model", ("quokka", "narwhal", "axolotl"))
    evaluate = load_tool("eval_gsm8k").main
    assert evaluate(argv + ["--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer {other}: ") and err.count("\n") == 1
    assert f"the run's data.tokenizer_model {run_tokenizer}" in err
    assert err.endswith("(not the tokenizer this model was trained with)\n")
    if HF_TOKENIZER.is_file():  # 50257 ids for a model of 512 rows; the run's tokenizer gone
        run_tokenizer.unlink()
        assert evaluate(argv + ["--tokenizer", str(HF_TOKENIZER), "--tokenizer-type",
                                "HuggingFaceTokenizer"]) == 2
        assert capsys.readouterr().err == (
            f"error: --tokenizer {HF_TOKENIZER}: ids up to 50256, past the model's vocab_size=512 "
            "(not the tokenizer this model was trained with)\n")
        _sentencepiece(run_tokenizer, ("cat", "dog", "emu"))
    # A copy of the run's tokenizer encodes as it does: the evaluation runs.
    copy = Path(shutil.copy(run_tokenizer, tmp_path / "copy.model"))
    assert evaluate(argv + ["--tokenizer", str(copy)]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 1


def test_decoding_stays_within_the_trained_context(mcore, tmp_path, capsys, caplog):
    """Before: 512 new tokens after the prompt of a 384-token model, without a word (exit 0)."""
    from megaloop.data import load_tokenizer

    run_tokenizer, argv = _run_with_tokenizer(tmp_path)
    evaluate = load_tool("eval_gsm8k").main
    assert evaluate(argv) == 2  # the default 512 new tokens
    assert capsys.readouterr().err == (
        f"error: --max-new-tokens 512: leaves no room for a prompt in the model's 128-token "
        f"context (model.seq_length of {Path(argv[0]) / 'iter_0000000'}); pass a smaller "
        "--max-new-tokens\n")
    prompt = len(load_tokenizer("SentencePieceTokenizer", run_tokenizer).encode_batch(
        [gsm8k.PROMPT.format(question="1+1?")])[0])
    assert evaluate(argv + ["--max-new-tokens", "120", "--uncached"]) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "megaloop.gsm8k"] == [
        f"1 of 1 questions: the prompt (up to {prompt} tokens) and max_new_tokens=120 run past "
        "the model's 128-token context (model.seq_length); they generate only up to it (summary "
        "cut_at_context)"]
    assert json.loads(capsys.readouterr().out)["cut_at_context"] == 1
    row = json.loads((tmp_path / "p.jsonl").read_text())
    assert row["stopped_at_context"] and row["new_tokens"] == 128 - prompt
    assert evaluate(argv + ["--max-new-tokens", "3", "--uncached", "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["cut_at_context"] == 0
    assert not json.loads((tmp_path / "p.jsonl").read_text())["stopped_at_context"]


def test_a_reference_without_its_final_number_is_an_error_before_decoding():
    records = [{"question": "q", "answer": "#### 3"}, {"question": "q", "answer": "3 apples"}]
    with pytest.raises(DataError, match=r"test.jsonl: record 2: its answer has no '#### "
                                        r"<number>' to score against \(ends '3 apples'\)"):
        gsm8k.evaluate(None, None, records, source="test.jsonl")


def test_a_legacy_tokenizer_run_is_fine_tuned_and_evaluated_with_its_eod(mcore, tmp_path,
                                                                         monkeypatch, capsys):
    """data.legacy_tokenizer=true ends documents with the added <EOD> id (32002 with LLaMA-2's
    32000 pieces), not eos 2: fine-tuning and evaluation tokenise as the base run did."""
    from megaloop.data.tokenizer import LegacySentencePieceTokenizer
    from megaloop.training.data import text_tokenizer

    if not SP_MODEL.is_file():
        pytest.skip(f"{SP_MODEL} not available")
    base = tmp_path / "base" / "checkpoints"
    _save_tiny(base, data={"tokenizer_model": str(SP_MODEL), "legacy_tokenizer": True},
               vocab_size=32128)
    cfg = gsm8k.finetune_config(base, ["train.jsonl"], str(tmp_path / "out"))
    assert cfg.data.legacy_tokenizer and text_tokenizer(cfg).eod == 32002
    used = []

    def record_tokenizer(model, tokenizer, records, **options):
        used.append(tokenizer)
        raise DataError("stopped before decoding")

    monkeypatch.setattr(gsm8k, "evaluate", record_tokenizer)
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    assert load_tool("eval_gsm8k").main([str(base), "--test", str(tmp_path / "t.jsonl"),
                                         "--max-new-tokens", "8"]) == 2
    assert "stopped before decoding" in capsys.readouterr().err
    assert isinstance(used[0], LegacySentencePieceTokenizer) and used[0].eod == 32002


@pytest.fixture(scope="module")
def gsm8k_files():
    for path in (GSM8K_TRAIN, GSM8K_TEST, SP_MODEL):
        if not path.is_file():
            pytest.skip(f"{path} not available")
    return GSM8K_TRAIN, GSM8K_TEST, SP_MODEL


def test_a_rerun_resumes_from_the_base_checkpoint_it_started_from(mcore, gsm8k_files, tmp_path,
                                                                 capsys):
    """Before: once the base run had moved on (iter_1 saved, iter_0 the fine-tune started from
    pruned), the same command re-resolved --base to iter_1 and exited 2, having overwritten
    finetune.yaml with a config that no longer matched the run."""
    import yaml

    run_tokenizer = _sentencepiece(tmp_path / "run.model", ("cat", "dog", "emu"))
    base = tmp_path / "base" / "checkpoints"
    _save_tiny(base, data={"tokenizer_model": str(run_tokenizer)}, vocab_size=512)
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(gsm8k_files[0].read_text().splitlines()[:12]) + "\n")
    run = tmp_path / "ft"
    options = ["--data", str(train), "--out", str(run), "train.train_steps=1",
               "train.global_batch_size=4", "train.micro_batch_size=4", "data.split=10,2,0",
               "train.eval_iters=1", "train.tensorboard=false"]
    finetune = load_tool("finetune_gsm8k").main
    assert finetune(["--base", str(base)] + options) == 0
    written = (run / "finetune.yaml").read_text()
    assert yaml.safe_load(written)["checkpoint"]["load"] == str(base / "iter_0000000")
    _save_tiny(base, data={"tokenizer_model": str(run_tokenizer)}, step=1, vocab_size=512)
    assert not (base / "iter_0000000").exists()
    capsys.readouterr()
    assert finetune(["--base", str(base)] + options) == 0  # at its step 1 already: done
    assert (run / "finetune.yaml").read_text() == written
    # A setting changed for a finished run is not applied: the config it trained with stays.
    # Before: finetune.yaml took train.lr=5e-05 (config.yaml kept the run's).
    assert finetune(["--base", str(base), "train.lr=5e-5"] + options) == 0
    assert (run / "finetune.yaml").read_text() == written
    # --base naming another checkpoint itself: a new start, which a resume cannot take.
    assert finetune(["--base", str(base / "iter_0000001")] + options) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"error: checkpoint.load={str(base / 'iter_0000001')!r}: differs from "
        f"{str(base / 'iter_0000000')!r} in {run / 'checkpoints' / 'iter_0000001' / 'config.yaml'}"
        f", and a resume cannot apply it ({run / 'checkpoints'} holds this run's own checkpoints, "
        "which a resume continues; to start from another checkpoint use another checkpoint.dir); "
        "set it back, or start a new run")
    assert (run / "finetune.yaml").read_text() == written  # before the fix: load iter_1


def test_finetune_then_evaluate_on_gsm8k_end_to_end(mcore, gsm8k_files, tmp_path, capsys,
                                                    monkeypatch):
    import errno

    import torch
    import yaml

    import megaloop.api as ml
    from megaloop.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig
    from megaloop.data import load_tokenizer
    from megaloop.generation import FullForward, greedy_generate
    from megaloop.training.trainer import Trainer

    train_file, test_file, tokenizer_file = gsm8k_files
    lines = train_file.read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:12]) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(test_file.read_text().splitlines()[:2]) + "\n")
    # The "pre-trained" checkpoint: initial weights of a tiny model with the LLaMA-2 vocabulary.
    base = RunConfig(
        model=ModelConfig(arch="asymloop", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                          num_attention_heads=2, vocab_size=32128, seq_length=512),
        train=TrainConfig(out_dir=str(tmp_path / "base"), tensorboard=False),
        data=DataConfig(path=[str(tmp_path / "train.jsonl")], format="sft", split="1",
                        tokenizer_model=str(tokenizer_file), sft_prompt=gsm8k.PROMPT,
                        sft_solution=gsm8k.SOLUTION),
        checkpoint=CheckpointConfig())
    seed = Trainer(base)
    seed.save()
    seed.close()

    finetune = load_tool("finetune_gsm8k").main
    run = tmp_path / "sft"
    assert finetune(["model.seq_length=512",  # overrides may come before the options too
                     "--base", str(tmp_path / "base" / "checkpoints"), "--data",
                     str(tmp_path / "train.jsonl"), "--out", str(run), "--epochs", "1",
                     "train.global_batch_size=4",
                     "train.micro_batch_size=4", "data.split=10,2,0", "train.eval_iters=1",
                     "train.tensorboard=false", "train.log_interval=100"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["train_steps"] == 3  # 1 epoch of the 10 training records at batch 4
    assert saved["checkpoint"]["load"].endswith("iter_0000000")
    assert (run / "checkpoints" / "iter_0000003").is_dir()
    capsys.readouterr()

    evaluate = load_tool("eval_gsm8k").main
    predictions = tmp_path / "out" / "predictions.jsonl"
    argv = [str(run / "checkpoints"), "--test", str(tmp_path / "test.jsonl"),
            "--max-new-tokens", "6", "--predictions", str(predictions)]
    assert evaluate(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["total"] == 2 and 0 <= summary["accuracy"] <= 1
    assert summary["decoder"] == "cached"
    assert summary["correct"] == round(summary["accuracy"] * 2)
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and [r["reference"] for r in rows] == ["18", "3"]
    assert list(predictions.parent.iterdir()) == [predictions]  # no temporary left behind
    tokenizer = load_tokenizer("SentencePieceTokenizer", tokenizer_file)
    model = ml.load(run / "checkpoints")
    for row, line in zip(rows, (tmp_path / "test.jsonl").read_text().splitlines()):
        record = json.loads(line)
        assert row["question"] == record["question"] and row["new_tokens"] <= 6
        assert row["correct"] == gsm8k.same_number(row["prediction"], row["reference"])
        assert row["prediction"] == gsm8k.extract_answer(row["generation"])[0]
        prompt = tokenizer.encode_batch([gsm8k.PROMPT.format_map(record)])[0]
        out = greedy_generate(FullForward(model), prompt, 6, tokenizer.eod, tokenizer.vocab_size)
        assert tokenizer.decode(out.tokens) == row["generation"]
        with torch.no_grad():  # each token the argmax of the full forward of what precedes it
            logits = model(torch.tensor([prompt + out.tokens]))[0, len(prompt) - 1:-1]
        assert out.tokens == logits[:, :tokenizer.vocab_size].argmax(-1).tolist()
    capsys.readouterr()
    # The canonical model without a cache (the reference) predicts what the cached decoder did.
    assert evaluate(argv + ["--uncached"]) == 2  # the predictions are there: refused
    assert capsys.readouterr().err.splitlines() == [
        f"error: --predictions {predictions}: exists; pass --overwrite to replace it, or choose "
        "another path"]
    assert [json.loads(line) for line in predictions.read_text().splitlines()] == rows
    assert evaluate(argv + ["--uncached", "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["decoder"] == "uncached"
    assert [json.loads(line) for line in predictions.read_text().splitlines()] == rows

    def full_disk(path, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gsm8k, "write_predictions", full_disk)
    assert evaluate(argv + ["--limit", "1", "--overwrite"]) == 2  # the accuracy is printed
    out, err = capsys.readouterr()
    assert json.loads(out)["total"] == 1 and json.loads(out)["predictions"] is None
    assert err.splitlines()[-1] == (f"error: --predictions {predictions}: not written (No space "
                                    "left on device)")
