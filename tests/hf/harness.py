"""Helpers of the LM Evaluation Harness tests: tiny exports with the LLaMA-2 tokenizer, the shared
benchmark samples, 3-record files of the tasks without samples, and an independent scorer (the
prompt each task should build from its raw fields, scored by the model's own forward)."""

import json
from pathlib import Path

import pytest
import torch

from tests.data.conftest import SHARED_DATA, SP_MODEL

EVAL_DATA = SHARED_DATA / "eval"
SAMPLE_TASKS = ("piqa", "siqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
                "openbookqa")

# Three records per task in the standard (Hugging Face dataset) fields.
WRITTEN = {
    "lambada_test.jsonl": [
        {"text": "She opened the door and the cold air rushed in, so she reached for her coat"},
        {"text": "The cat sat by the window all day, watching the birds in the garden"},
        {"text": "After the long climb they rested at the top and looked down at the valley"},
    ],
    "sciq_test.jsonl": [
        {"question": "What gas do plants absorb from the air?", "distractor1": "oxygen",
         "distractor2": "helium", "distractor3": "nitrogen",
         "correct_answer": "carbon dioxide", "support": " Plants take in carbon dioxide."},
        {"question": "What is the center of an atom called?", "distractor1": "shell",
         "distractor2": "orbit", "distractor3": "cloud", "correct_answer": "nucleus",
         "support": ""},
        {"question": "Which organ pumps blood?", "distractor1": "lung", "distractor2": "liver",
         "distractor3": "kidney", "correct_answer": "heart", "support": "The heart is a pump."},
    ],
    "mmlu_test.jsonl": [
        {"question": "What is 2 + 3?", "subject": "elementary_mathematics",
         "choices": ["4", "5", "6", "7"], "answer": 1},
        {"question": "Which planet is closest to the Sun?", "subject": "astronomy",
         "choices": ["Venus", "Earth", "Mercury", "Mars"], "answer": 2},
        {"question": " Who wrote Hamlet? ", "subject": "world_religions",
         "choices": ["Shakespeare", "Marlowe", "Jonson", "Bacon"], "answer": 0},
    ],
    "mmlu_dev.jsonl": [
        {"question": "What is 1 + 1?", "subject": "elementary_mathematics",
         "choices": ["1", "2", "3", "4"], "answer": 1},
        {"question": "What is 3 x 3?", "subject": "elementary_mathematics",
         "choices": ["6", "8", "9", "12"], "answer": 2},
        {"question": "What is the Moon?", "subject": "astronomy",
         "choices": ["a star", "a satellite", "a planet", "a comet"], "answer": 1},
    ],
}


def require_harness():
    """Skips unless lm-eval (with accelerate), the LLaMA-2 tokenizer and the samples are here."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    for path in (SP_MODEL, EVAL_DATA / "piqa_valid.jsonl"):
        if not path.is_file():
            pytest.skip(f"{path} not available")


def write_standard_files(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, records in WRITTEN.items():
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def records(data_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (data_dir / name).read_text().splitlines()]


def _mc(context, choices, gold):
    return [(context, " " + c) for c in choices], gold


def expected_requests(task: str, r: dict):
    """((context, continuation) per choice, gold index) a 0-shot task should score."""
    if task == "piqa":
        return _mc(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r["label"])
    if task == "siqa":
        return _mc(f"Q: {r['context']} {r['question']}\nA:",
                   [r["answerA"], r["answerB"], r["answerC"]], int(r["label"]) - 1)
    if task == "hellaswag":
        return _mc(f"{r['activity_label']}: {r['ctx']}", r["endings"], int(r["label"]))
    if task == "winogrande":
        blank = r["sentence"].index("_")
        rest = " " + r["sentence"][blank + 1:].strip()
        return ([(r["sentence"][:blank] + r[f"option{i}"], rest) for i in (1, 2)],
                int(r["answer"]) - 1)
    if task in ("arc_easy", "arc_challenge", "openbookqa"):
        stem = r["question"]["stem"]
        choices = r["question"]["choices"]
        context = stem if task == "openbookqa" else f"Question: {stem}\nAnswer:"
        return _mc(context, [c["text"] for c in choices],
                   [c["label"] for c in choices].index(r["answerKey"]))
    if task == "lambada":
        words = r["text"].split(" ")
        return [(" ".join(words[:-1]), " " + words[-1])], 0
    if task == "sciq":
        return _mc(f"{r['support'].lstrip()}\nQuestion: {r['question']}\nAnswer:",
                   [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]], 3)
    if task == "mmlu":
        subject = r["subject"].replace("_", " ")
        options = "".join(f"\n{letter}. {c}" for letter, c in zip("ABCD", r["choices"]))
        return _mc(f"The following are multiple choice questions (with answers) about {subject}."
                   f"\n\n{r['question'].strip()}{options}\nAnswer:", "ABCD", r["answer"])
    raise KeyError(task)


def loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """(sum of the continuation's token log-probabilities after the context, whether each of its
    tokens is the argmax), from one forward."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    prefix = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([whole])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits[prefix - 1:-1], dim=-1)
    target = ids[0, prefix:]
    return (float(logprobs.gather(1, target[:, None]).sum()),
            bool((logprobs.argmax(-1) == target).all()))
