"""Small supervised fine-tuning data for tests, made here (no shared files): GSM8K-shaped
arithmetic records and a SentencePiece tokenizer trained on them."""

import json
import random
from pathlib import Path

PROMPT, SOLUTION = "Question: {question}\nAnswer:", "{answer}"


def arithmetic_records(count: int, seed: int = 0) -> list[dict]:
    """Records with GSM8K's fields and answer format ("... #### 12")."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        records.append({"question": f"Tom has {a} apples and buys {b} more. How many apples "
                                    "does he have?",
                        "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n"
                                  f"#### {a + b}"})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train_tokenizer(path: Path, records: list[dict]) -> Path:
    from megaloop.data.tokenizer_training import train_sentencepiece

    lines = [line for r in records for text in (r["question"], r["answer"])
             for line in text.splitlines()] + ["Question:", "Answer:"]
    train_sentencepiece(lines, path, vocab_size=400, hard_vocab_limit=False, threads=1)
    return path
