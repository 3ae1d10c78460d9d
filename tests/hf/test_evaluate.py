"""The LM Evaluation Harness on tiny exports, offline, from local files: every shipped task builds the
prompt its raw fields call for (checked against an independent construction) and scores it with
the model's own log-likelihoods; few-shot examples come from the file and never hold the question;
test-time depth reaches the model; lm-eval's own CLI loads an export (native and remote code) and
agrees with the in-process run; tools/evaluate.py goes from a checkpoint to a table, and refuses bad
input in one line."""

import functools
import json
import re
import shutil

import pytest
import torch

from megaloop.config import DataConfig, ModelConfig, RunConfig
from tests.data.conftest import SP_MODEL
from tests.tool_scripts import load_tool
from tests.hf.harness import (EVAL_DATA, SAMPLE_TASKS, expected_requests, loglikelihood, records,
                              require_harness, write_standard_files)

SAMPLE_FILES = {"piqa": "piqa_valid.jsonl", "siqa": "siqa_dev.jsonl",
                "hellaswag": "hellaswag_val_sample.jsonl", "winogrande": "winogrande_dev.jsonl",
                "arc_easy": "arc_easy_dev.jsonl", "arc_challenge": "arc_challenge_dev.jsonl",
                "openbookqa": "openbookqa_test.jsonl", "gsm8k": "gsm8k_test.jsonl",
                "lambada": "lambada_test.jsonl", "sciq": "sciq_test.jsonl",
                "mmlu": "mmlu_test.jsonl"}
TINY = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
            vocab_size=32128, seq_length=2048)


class Export:
    def __init__(self, checkpoint, directory):
        from megaloop.hf.from_hf import load_hf_model
        from transformers import AutoTokenizer

        self.checkpoint, self.directory = checkpoint, directory
        self.model = load_hf_model(directory)[0]
        self.tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)


@pytest.fixture(scope="module")
def harness(mcore, tmp_path_factory):
    """Exports of a tiny AsymLoop, LatentLoop (remote code) and Dense (native Llama) model with
    the LLaMA-2 tokenizer, and one data directory with the samples and the written files."""
    require_harness()
    from megaloop.hf import evaluate as ev
    from megaloop.hf.checkpoint import build_single_process_model, save_weights_checkpoint
    from megaloop.hf.common import quiet_transformers
    from megaloop.hf.to_hf import export_checkpoint

    quiet_transformers()
    ev.quiet_harness()
    root = tmp_path_factory.mktemp("harness")
    data = write_standard_files(root / "data")
    for name in SAMPLE_FILES.values():
        if (EVAL_DATA / name).is_file():
            (data / name).symlink_to(EVAL_DATA / name)
    exports = {}
    for arch, fields in (("asymloop", dict(encoder_layers=1, iterations=2)),
                         ("dense", dict(iterations=1)),
                         ("latentloop", dict(iterations=2, num_layers=3))):
        torch.manual_seed(0)
        cfg = ModelConfig(arch=arch, **{**TINY, **fields}, init_std=0.1)
        model = build_single_process_model(cfg)
        run = RunConfig(model=cfg, data=DataConfig(tokenizer_model=str(SP_MODEL)))
        checkpoint = save_weights_checkpoint(model, run, root / arch / "checkpoint")
        export_checkpoint(checkpoint, root / arch / "hf")
        exports[arch] = Export(checkpoint, root / arch / "hf")
    return {"data": data, "manager": ev.task_manager(data), **exports}


def _run(harness, export, tasks, batch_size=4, **kwargs):
    from megaloop.hf import evaluate as ev

    names = ev.resolve_tasks(tasks, harness["manager"])
    lm = ev.harness_model(export.model, export.tokenizer, batch_size=batch_size)
    return ev.run_harness(lm, names, harness["manager"], log_samples=True, **kwargs)


def test_every_task_scores_the_prompt_its_fields_call_for(harness):
    export = harness["asymloop"]
    tasks = SAMPLE_TASKS + ("lambada", "sciq", "mmlu")
    results = _run(harness, export, tasks, num_fewshot=0, limit=2)
    assert sorted(results["samples"]) == sorted(f"local_{t}" for t in tasks)
    for task in tasks:
        samples = results["samples"][f"local_{task}"]
        raw = records(harness["data"], SAMPLE_FILES[task])
        assert [s["doc_id"] for s in samples] == [0, 1]
        for sample in samples:
            requests, gold = expected_requests(task, raw[sample["doc_id"]])
            assert [tuple(a) for a in sample["arguments"]] == requests, task
            scores = [float(r[0]) for r in sample["filtered_resps"]]
            expected = [loglikelihood(export.model, export.tokenizer, *r) for r in requests]
            assert scores == pytest.approx([e[0] for e in expected], rel=1e-4, abs=1e-3), task
            if task == "lambada":  # one continuation: correct when every token is the argmax
                assert sample["target"] == requests[0][1]
                assert sample["acc"] == float(expected[0][1])
                continue
            if task != "winogrande":  # its target is the shared continuation, not an index
                assert int(sample["target"]) == gold, task
            assert sample["acc"] == float(max(range(len(scores)), key=scores.__getitem__) == gold)
        accuracy = results["results"][f"local_{task}"]["acc,none"]
        assert accuracy == pytest.approx(sum(s["acc"] for s in samples) / 2)


def test_few_shot_examples_come_from_the_file_and_leave_the_question_out(harness, tmp_path):
    from megaloop.hf import evaluate as ev

    # Three records and two shots: the examples must be exactly the two other records.
    data = write_standard_files(tmp_path)
    lines = (harness["data"] / SAMPLE_FILES["piqa"]).read_text().splitlines()[:3]
    (data / SAMPLE_FILES["piqa"]).write_text("\n".join(lines) + "\n")
    export = harness["asymloop"]
    results = _run({**harness, "manager": ev.task_manager(data)}, export, ["piqa", "mmlu"],
                   num_fewshot=2, limit=3)
    piqa = records(data, SAMPLE_FILES["piqa"])
    shown = [f"Question: {r['goal']}\nAnswer: {r['sol1' if r['label'] == 0 else 'sol2']}"
             for r in piqa]
    for sample in results["samples"]["local_piqa"]:
        own, _ = expected_requests("piqa", piqa[sample["doc_id"]])
        *examples, question = sample["arguments"][0][0].split("\n\n")
        assert question == own[0][0]
        assert sorted(examples) == sorted(e for i, e in enumerate(shown) if i != sample["doc_id"])
    dev = records(data, "mmlu_dev.jsonl")
    for sample in results["samples"]["local_mmlu"]:
        doc = records(data, "mmlu_test.jsonl")[sample["doc_id"]]
        context = sample["arguments"][0][0]
        assert context.startswith("The following are multiple choice questions (with answers) "
                                  f"about {doc['subject'].replace('_', ' ')}.\n\n")
        assert sum(r["question"] in context for r in dev) == 2
        assert context.endswith(f"{doc['question'].strip()}\nA. {doc['choices'][0]}\nB. "
                                f"{doc['choices'][1]}\nC. {doc['choices'][2]}\nD. "
                                f"{doc['choices'][3]}\nAnswer:")


def test_generation_task_runs_greedy_decoding_through_the_cache(harness):
    export = harness["asymloop"]
    results = _run(harness, export, ["gsm8k"], num_fewshot=0, limit=1,
                   gen_kwargs={"max_gen_toks": 6})
    sample = results["samples"]["local_gsm8k"][0]
    question = records(harness["data"], SAMPLE_FILES["gsm8k"])[0]["question"]
    prompt = export.tokenizer(f"Question: {question}\nAnswer:", return_tensors="pt")["input_ids"]
    greedy = export.model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    expected = export.tokenizer.decode(greedy[0, prompt.shape[1]:])
    assert sample["resps"][0][0] == expected.split("Question:")[0]
    assert 0 <= results["results"]["local_gsm8k"]["exact_match,strict-match"] <= 1


def test_generation_never_chooses_the_embedding_rows_past_the_tokenizer(harness):
    """A model whose generation config suppresses nothing (training's downstream evaluation
    passes ``to_reference(model)``; an export before suppress_tokens) and whose padding rows
    32000-32127 score highest: the harness generates from the tokenizer's 32000 rows, as
    megaloop's greedy decoding does (before: padding ids, which decode to nothing)."""
    import copy
    import types

    export = harness["asymloop"]
    model = copy.deepcopy(export.model)
    model.generation_config.suppress_tokens = None
    with torch.no_grad():
        model.lm_head.weight[32000:] *= 50
    results = _run(harness, types.SimpleNamespace(model=model, tokenizer=export.tokenizer),
                   ["gsm8k"], num_fewshot=0, limit=1, gen_kwargs={"max_gen_toks": 6})
    question = records(harness["data"], SAMPLE_FILES["gsm8k"])[0]["question"]
    prompt = export.tokenizer(f"Question: {question}\nAnswer:", return_tensors="pt")["input_ids"]
    unsuppressed = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert int(unsuppressed[0, prompt.shape[1]:].min()) >= 32000  # padding rows only
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False,
                            suppress_tokens=list(range(32000, 32128)))
    expected = export.tokenizer.decode(greedy[0, prompt.shape[1]:]).split("Question:")[0]
    assert expected.strip()
    assert results["samples"]["local_gsm8k"][0]["resps"][0][0] == expected


@pytest.mark.parametrize("arch", ["latentloop", "asymloop"])
def test_batched_generation_gives_each_prompt_its_own_tokens(harness, arch):
    """Prompts of different lengths, left-padded into one batch, which shifts LatentLoop's groups
    of k tokens against each other: the answers are those of batch size 1."""
    export = harness[arch]
    answers = {}
    for batch_size in (1, 3):
        samples = _run(harness, export, ["gsm8k"], batch_size=batch_size, num_fewshot=0,
                       limit=3, gen_kwargs={"max_gen_toks": 6})["samples"]["local_gsm8k"]
        answers[batch_size] = {s["doc_id"]: s["resps"][0][0] for s in samples}
    prompts = {len(export.tokenizer(r["question"])["input_ids"])
               for r in records(harness["data"], SAMPLE_FILES["gsm8k"])[:3]}
    assert len(prompts) == 3  # three lengths: the batch is padded
    assert answers[3] == answers[1]


def test_test_time_depth_reaches_the_model_and_is_restored(harness):
    from megaloop.hf import evaluate as ev

    export = harness["asymloop"]
    scores = {}
    for depth in (1, 3):
        ev.set_depth(export.model, depth)
        try:
            sample = _run(harness, export, ["piqa"], num_fewshot=0, limit=1)["samples"][
                "local_piqa"][0]
            expected = [loglikelihood(export.model, export.tokenizer, *r)[0] for r in
                        sample["arguments"]]  # the forward reads config.iterations
        finally:
            ev.set_depth(export.model, 2)
        scores[depth] = [float(r[0]) for r in sample["filtered_resps"]]
        assert scores[depth] == pytest.approx(expected, rel=1e-4, abs=1e-3)
    assert scores[1] != pytest.approx(scores[3], rel=1e-3)
    rows = ev.evaluate(export.model, export.tokenizer, ["winogrande"], data_dir=harness["data"],
                       depths=(1, 3, 1), num_fewshot=(0, 0), limit=2)  # each setting once
    assert [(r["task"], r["iterations"], r["samples"]) for r in rows] == [
        ("winogrande", 1, 2), ("winogrande", 3, 2)]
    assert export.model.config.iterations == 2
    with pytest.raises(ev.EvaluationError, match=r"^depth 2: LlamaForCausalLM "
                                                 r"\(model_type=llama\): arch=dense has no depth "
                                                 "to vary"):
        ev.evaluate(harness["dense"].model, harness["dense"].tokenizer, ["piqa"],
                    data_dir=harness["data"], depths=(1, 2))
    assert ev.set_depth(harness["dense"].model, 1) is None  # its own depth: nothing to set


def test_a_continuation_longer_than_the_context_is_one_line(harness):
    from megaloop.hf import evaluate as ev

    export = harness["dense"]
    names = ev.resolve_tasks(["piqa"], harness["manager"])
    lm = ev.harness_model(export.model, export.tokenizer, batch_size=4)
    lm._max_length = 3  # piqa's solutions are longer than three tokens
    with pytest.raises(ev.EvaluationError, match=r"^a continuation of \d+ tokens does not fit "
                                                 r"the model's 3-token context \("):
        ev.run_harness(lm, names, harness["manager"], num_fewshot=0, limit=2)


def test_new_tokens_that_leave_no_room_for_a_prompt_is_one_line(harness, monkeypatch):
    """Found before any task runs: GSM8K comes after seven log-likelihood tasks here. New tokens
    given where no task generates are refused too, not ignored."""
    from megaloop.hf import evaluate as ev

    export = harness["dense"]
    monkeypatch.setattr(export.model.config, "max_position_embeddings", 16)
    forwards = []
    monkeypatch.setattr(export.model, "forward", lambda *a, **k: forwards.append(1))
    with pytest.raises(ev.EvaluationError, match=r"^max_gen_toks 16 \(task gsm8k\): leaves no "
                                                 r"room for a prompt in the model's 16-token"):
        ev.evaluate(export.model, export.tokenizer, ["asymloop_tasks", "gsm8k"],
                    data_dir=harness["data"], limit=1, max_gen_toks=16)
    assert forwards == []
    with pytest.raises(ev.EvaluationError, match=r"^max_gen_toks 8: none of the tasks generates "
                                                 r"text \(it sets"):  # before: ignored
        ev.evaluate(export.model, export.tokenizer, ["piqa"], data_dir=harness["data"], limit=1,
                    max_gen_toks=8)
    assert forwards == []
    names = ev.resolve_tasks(["gsm8k"], harness["manager"])
    lm = ev.harness_model(export.model, export.tokenizer, batch_size=2)
    lm._max_length = 16
    for gen_kwargs, new_tokens in ((None, 256), ({"max_gen_toks": 16}, 16)):
        with pytest.raises(ev.EvaluationError, match=rf"^max_gen_toks {new_tokens} \(task gsm8k\): "
                                                     r"leaves no room for a prompt in the model's "
                                                     r"16-token context"):
            ev.run_harness(lm, names, harness["manager"], num_fewshot=0, limit=1,
                           gen_kwargs=gen_kwargs)


@pytest.mark.parametrize("arch, task", [("dense", "piqa"), ("asymloop", "piqa"),
                                        ("latentloop", "gsm8k")])
def test_lm_eval_cli_loads_the_export_offline(harness, arch, task, tmp_path, monkeypatch):
    """GSM8K on LatentLoop: prompts of three lengths, generated in left-padded batches of 2 by
    the export's own code (before: its ValueError on padding failed lm-eval's CLI)."""
    import lm_eval.tasks
    from lm_eval._cli import HarnessCLI

    from megaloop.hf import evaluate as ev

    export = harness[arch]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # The CLI indexes lm-eval's ~14,000 built-in task files (seconds) before it finds ours.
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    cli = HarnessCLI()
    args = cli._parser.parse_args([
        "run", "--model", "hf", "--model_args",
        f"pretrained={export.directory},trust_remote_code=True,dtype=float32",
        "--tasks", f"local_{task}", "--include_path", str(ev.TASK_DIR), "--limit", "3",
        "--metadata", json.dumps({"data_dir": str(harness["data"])}), "--batch_size", "2",
        "--gen_kwargs", json.dumps({"max_gen_toks": 6}), "--log_samples",
        "--output_path", str(tmp_path / "out")])
    cli.execute(args)
    [result_file] = (tmp_path / "out").rglob("results_*.json")
    via_cli = json.loads(result_file.read_text())["results"][f"local_{task}"]
    if task == "piqa":
        [row] = ev.evaluate(export.model, export.tokenizer, ["piqa"], data_dir=harness["data"],
                            limit=3)
        assert (via_cli["acc,none"], via_cli["acc_norm,none"]) == (row["acc"], row["acc_norm"])
        return
    [samples_file] = (tmp_path / "out").rglob("samples_*.jsonl")
    answers = {s["doc_id"]: s["resps"][0][0] for s in map(json.loads, samples_file.open())}
    alone = _run(harness, export, ["gsm8k"], batch_size=1, num_fewshot=0, limit=3,
                 gen_kwargs={"max_gen_toks": 6})["samples"]["local_gsm8k"]
    assert answers == {s["doc_id"]: s["resps"][0][0] for s in alone}
    assert len(set(answers.values())) == 3  # three different answers


def test_tool_writes_the_table_from_a_checkpoint(harness, tmp_path, capsys):
    evaluate = load_tool("evaluate").main
    out = tmp_path / "results" / "tiny"
    assert evaluate([str(harness["asymloop"].checkpoint.parent), "--data-dir",
                     str(harness["data"]), "--tasks", "piqa", "latentloop_tasks",
                     "--depths", "1", "2", "--limit", "2", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert table == out.with_suffix(".md").read_text()
    lines = table.splitlines()
    assert lines[0] == "| task | metric | n | 0-shot, K=1 | 0-shot, K=2 |"
    result = json.loads(out.with_suffix(".json").read_text())
    tasks = {"piqa", "lambada", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "sciq",
             "mmlu"}
    assert {r["task"] for r in result["rows"]} == tasks and len(result["rows"]) == 8 * 2
    assert result["class"] == "LoopedLM" and result["probe_max_abs_difference"] < 1e-4
    for row in result["rows"]:
        assert row["samples"] == 2 and row["score"] == row["acc"]
        cell = f"{100 * row['score']:.1f}"
        assert cell in next(line for line in lines if line.startswith(f"| {row['task']} |"))
    assert lines[-1].startswith("| mean (8 tasks) |")
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.json", "tiny.md"]
    # Run again (another checkpoint, the same --output): refused before the evaluation, the
    # results left as they were. Before: replaced without a word.
    assert evaluate([str(harness["dense"].directory), "--data-dir", str(harness["data"]),
                     "--tasks", "piqa", "--limit", "2", "--output", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --output {out}: {out}.md and {out}.json exist; pass --overwrite to replace "
        "them, or choose another --output"]
    assert out.with_suffix(".md").read_text() == table


def test_results_that_cannot_be_written_at_the_end_still_print_the_table(harness, tmp_path,
                                                                        capsys, monkeypatch):
    """Before: an OSError traceback after the whole evaluation, its scores lost."""
    import errno

    import megaloop.platform.files as files

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "write_text_atomic", full_disk)
    out = tmp_path / "piqa"
    assert load_tool("evaluate").main([str(harness["asymloop"].directory), "--data-dir",
                                       str(harness["data"]), "--tasks", "piqa", "--limit", "2",
                                       "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "| task | metric | n | 0-shot, K=2 |"
    assert captured.out.splitlines()[2].startswith("| piqa | acc | 2 |")
    assert captured.err.splitlines()[-1] == (f"error: --output {out}: not written (No space left "
                                             "on device)")


def test_tool_results_record_the_settings_that_change_scores(harness, tmp_path):
    """OUTPUT.json names --max-gen-toks beside --limit and --data-dir (before: left out, so two
    gsm8k result files with other cut-offs could not be told apart)."""
    out = tmp_path / "gsm"
    out.with_suffix(".json").write_text("{}")  # an earlier evaluation's, replaced as asked
    assert load_tool("evaluate").main([str(harness["asymloop"].directory), "--data-dir",
                                       str(harness["data"]), "--tasks", "gsm8k", "--limit", "1",
                                       "--max-gen-toks", "3", "--output", str(out),
                                       "--overwrite"]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert (result["max_gen_toks"], result["limit"]) == (3, 1)


def test_tool_refuses_bad_input_in_one_line(harness, tmp_path, capsys):
    evaluate = load_tool("evaluate").main
    hf, data = str(harness["dense"].directory), str(harness["data"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "piqa_valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b", '
                                             '"label": 0}\n{not json\n')
    untokenized = tmp_path / "untokenized"
    shutil.copytree(harness["asymloop"].checkpoint, untokenized)
    config = untokenized / "config.yaml"
    config.write_text(config.read_text().replace(str(SP_MODEL), "null"))
    moved = tmp_path / "moved"  # its run's tokenizer file is gone
    shutil.copytree(harness["asymloop"].checkpoint, moved)
    config = moved / "config.yaml"
    config.write_text(config.read_text().replace(str(SP_MODEL), str(tmp_path / "gone.model")))
    cases = [
        ([hf, "--data-dir", data, "--tasks", "piqa", "nope"], "task 'nope': not in the task "
                                                              "directory (tasks: arc_challenge"),
        ([hf, "--data-dir", str(tmp_path / "none")], "none: no such data directory"),
        ([hf, "--data-dir", str(tmp_path), "--tasks", "sciq"],
         f"task data: {tmp_path}/sciq_test.jsonl: no such file"),
        ([hf, "--data-dir", str(broken), "--tasks", "piqa"],
         "piqa_valid.jsonl:2: not a JSON record"),
        ([str(untokenized), "--data-dir", data], "its run names no tokenizer"),
        # Before: "...; pass --tokenizer PATH, or --no-tokenizer", a flag of the export only.
        ([str(moved), "--data-dir", data], "gone.model: tokenizer file not found (the run's "
                                           "data.tokenizer_model); pass --tokenizer PATH"),
        ([str(moved), "--data-dir", data, "--tokenizer", "nope.model"],
         "nope.model: tokenizer file not found (--tokenizer); pass --tokenizer PATH"),
        ([hf, "--data-dir", data, "--tokenizer", str(SP_MODEL)], "only for a megaloop "
                                                                 "checkpoint"),
        ([str(tmp_path / "missing"), "--data-dir", data], "missing: no such checkpoint"),
        # Found before the evaluation, not after it.
        ([hf, "--data-dir", data, "--output", str(broken / "piqa_valid.jsonl" / "x")],
         "piqa_valid.jsonl is not a writable directory"),
        ([hf, "--data-dir", data, "--output", str(broken)], "broken.md: cannot be written (it is a directory); choose another --output"),
    ]
    (tmp_path / "broken.md").mkdir()
    for argv, message in cases:
        assert evaluate(argv + ["--output", str(tmp_path / "out" / "x")] * ("--output" not in argv)
                        ) == 2, message
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (message, err)
        assert "--no-tokenizer" not in err[0]  # the export's flag, not this tool's
    for flag in ("--limit", "--batch-size"):
        with pytest.raises(SystemExit) as exit_:
            evaluate([hf, "--data-dir", data, flag, "0"])
        assert exit_.value.code == 2
    assert not (tmp_path / "out").exists()



def test_depths_a_model_has_not_are_refused_before_any_export_or_load(harness, tmp_path,
                                                                      capsys, monkeypatch):
    """Dense has no depth; LatentLoop runs exactly its visits (2 here): found in the source's
    config, before a checkpoint is exported (before: after the export, from the loaded model)."""
    from megaloop.hf import evaluate as ev, from_hf, to_hf

    evaluate = load_tool("evaluate").main
    work = []
    monkeypatch.setattr(to_hf, "export_checkpoint", lambda *a, **k: work.append("export"))
    monkeypatch.setattr(from_hf, "load_hf_model", lambda *a, **k: work.append("load"))
    latent, dense = harness["latentloop"], harness["dense"]
    dense_refusal = ("arch=dense has no depth to vary (it would loop its layers; "
                     "arch=fullloop is the looped stack)")
    cases = [(latent.checkpoint, f"--depths 3: {latent.checkpoint}: arch=latentloop runs exactly "
                                 "its iterations=2 visits (each has its own scales)"),
             (latent.directory, f"--depths 3: {latent.directory}/config.json "
                                "(model_type=megaloop_latentloop): arch=latentloop runs exactly "
                                "its iterations=2 visits (each has its own scales)"),
             (dense.checkpoint, f"--depths 2: {dense.checkpoint}: {dense_refusal}"),
             (dense.directory, f"--depths 2: {dense.directory}/config.json (model_type=llama): "
                               f"{dense_refusal}")]
    for source, message in cases:  # the first refused depth is named: 3, and 2 on Dense
        own = "2" if source in (latent.checkpoint, latent.directory) else "1"
        assert evaluate([str(source), "--data-dir", str(harness["data"]), "--depths", own, "2",
                         "3", "--output", str(tmp_path / "x")]) == 2
        assert capsys.readouterr().err.strip().splitlines() == ["error: " + message]
    # Depth 1 is a Dense model's own (before: refused here, accepted by the model and eval_gsm8k).
    for source in (dense.checkpoint, dense.directory):
        ev.check_depths(source, [1])
    assert work == []


def test_tasks_and_their_data_are_refused_before_any_export_or_load(harness, tmp_path, capsys,
                                                                    monkeypatch):
    """An unknown task, a missing data directory, too few few-shot records or --max-gen-toks
    without a generation task is known from the task files: found before a checkpoint is exported
    (before: after it, minutes for a large model)."""
    from megaloop.hf import from_hf, to_hf

    evaluate = load_tool("evaluate").main

    def work(*args, **kwargs):
        raise AssertionError("exported or loaded before the tasks were checked")

    monkeypatch.setattr(to_hf, "export_checkpoint", work)
    monkeypatch.setattr(from_hf, "load_hf_model", work)
    few = tmp_path / "few"
    few.mkdir()
    (few / "piqa_valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}\n'
                                          * 2)
    checkpoint, data = str(harness["asymloop"].checkpoint.parent), str(harness["data"])
    cases = [(["--data-dir", data, "--tasks", "piqaa"], "error: task 'piqaa': not in the task "
                                                        "directory (tasks: arc_challenge"),
             (["--data-dir", str(tmp_path / "nonexistent")],
              f"error: {tmp_path / 'nonexistent'}: no such data directory"),
             (["--data-dir", str(few), "--tasks", "piqa", "--num-fewshot", "0", "5"],
              "error: num_fewshot 5: task piqa draws its examples from"),
             (["--data-dir", data, "--tasks", "piqa", "--max-gen-toks", "5"],
              "error: max_gen_toks 5: none of the tasks generates text")]
    for argv, message in cases:
        assert evaluate([checkpoint, *argv, "--output", str(tmp_path / "x")]) == 2, message
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), (message, err)


@pytest.mark.parametrize("edit", [lambda text: text[:-5], lambda text: json.dumps(
    {**json.loads(text), "iterations": "two"})])
def test_a_bad_config_json_is_the_same_one_line_error_as_for_an_import(harness, tmp_path, capsys,
                                                                       edit):
    """--depths reads a Hugging Face directory's config.json as an import does (before: by hand,
    with its own messages, and a field of the wrong type passed on unchecked)."""
    from megaloop.hf.common import ConversionError
    from megaloop.hf.from_hf import import_hf

    source = tmp_path / "hf"
    source.mkdir()
    text = (harness["latentloop"].directory / "config.json").read_text()
    (source / "config.json").write_text(edit(text))
    with pytest.raises(ConversionError) as error:
        import_hf(source, tmp_path / "imported")
    assert str(error.value).startswith(f"{source / 'config.json'}: ")
    assert load_tool("evaluate").main([str(source), "--data-dir", str(harness["data"]),
                                       "--depths", "2", "--output", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {error.value}"]


def test_more_shots_than_a_file_holds_is_one_line(harness, tmp_path):
    """The written SciQ and MMLU files hold three records: 3 shots leave SciQ's question out of
    three (4 needed); MMLU draws from its dev file (3 needed). lm-eval alone raises a bare
    ValueError from random.sample."""
    from megaloop.hf import evaluate as ev

    export = harness["dense"]
    with pytest.raises(ev.EvaluationError, match=r"^num_fewshot 3: task sciq draws its examples "
                                                 r"from sciq_test.jsonl, which holds 3 records "
                                                 r"\(4 needed, the question itself left out\)$"):
        ev.evaluate(export.model, export.tokenizer, ["mmlu", "sciq"], data_dir=harness["data"],
                    num_fewshot=(0, 3), limit=1)
    rows = ev.evaluate(export.model, export.tokenizer, ["mmlu", "sciq"], data_dir=harness["data"],
                       num_fewshot=(2,), limit=1)
    assert sorted(r["task"] for r in rows) == ["mmlu", "sciq"]


def test_requests_longer_than_the_context_are_counted_and_shown(harness, monkeypatch):
    """lm-eval cuts them from the left and only logs it (megaloop quiets its log): the rows and
    the table say how many, counted here from the scored prompts themselves."""
    from megaloop.hf import evaluate as ev

    export = harness["dense"]
    monkeypatch.setattr(export.model.config, "max_position_embeddings", 48)
    rows = ev.evaluate(export.model, export.tokenizer, ["piqa", "gsm8k"], data_dir=harness["data"],
                       num_fewshot=(0, 2), limit=3, max_gen_toks=8)

    def length(text):
        return len(export.tokenizer(text, add_special_tokens=False)["input_ids"])

    counts = {}
    for shots in (0, 2):
        samples = _run(harness, export, ["piqa", "gsm8k"], num_fewshot=shots, limit=3,
                       gen_kwargs={"max_gen_toks": 8})["samples"]
        piqa = [a for s in samples["local_piqa"] for a in s["arguments"]]
        # One sample per document and filter (GSM8K has two filters).
        gsm8k = {s["doc_id"]: s["arguments"][0][0] for s in samples["local_gsm8k"]}.values()
        counts[("piqa", shots)] = (len(piqa), sum(length(c + x) - 1 > 48 for c, x in piqa))
        counts[("gsm8k", shots)] = (len(gsm8k), sum(length(c) > 48 - 8 for c in gsm8k))
    assert {(r["task"], r["num_fewshot"]): (r["requests"], r["truncated"]) for r in rows} == counts
    assert 0 < counts[("piqa", 0)][1] < counts[("piqa", 2)][1] == 6, counts
    table = ev.markdown_table(rows)
    assert table.splitlines()[-1] == (
        "Longer than the model's context, cut from the left: " + "; ".join(
            f"{task} {shots}-shot: {cut} of {sent} requests"
            for (task, shots), (sent, cut) in counts.items() if cut) + ".")


def test_a_data_file_without_records_is_refused_parquet_as_json_lines(tmp_path):
    """examples/eval/local_files.py reads Parquet too; an empty one gave a task of no records
    (before: accepted, where an empty .jsonl was refused), caught here with the other task data."""
    require_harness()
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megaloop.hf import evaluate as ev

    tasks, data = tmp_path / "tasks", tmp_path / "data"
    shutil.copytree(ev.TASK_DIR, tasks)
    yaml = tasks / "piqa.yaml"
    yaml.write_text(yaml.read_text().replace("piqa_valid.jsonl", "piqa_valid.parquet"))
    data.mkdir()
    pq.write_table(pa.table({f: pa.array([], pa.string()) for f in ("goal", "sol1", "sol2")}
                            | {"label": pa.array([], pa.int64())}), data / "piqa_valid.parquet")
    with pytest.raises(ev.EvaluationError, match=r"^task data: .*piqa_valid.parquet: holds no "
                                                 r"records$"):
        ev.prepare_tasks(["piqa"], data, tasks)


@pytest.mark.parametrize("output", ["", ".", "/", "..", "results/.."])
def test_an_output_naming_a_directory_is_one_line(output):
    """Before: a ValueError traceback from pathlib ('.', '/', ''; exit 1, the code of a probe
    mismatch), or results written as '...md' ('..')."""
    from megaloop.hf.evaluate import EvaluationError, result_files

    with pytest.raises(EvaluationError, match=rf"^--output {re.escape(repr(output))}: names a "
                                              "directory, not the prefix of the results"):
        result_files(output)
