"""Users copy commands from README.md and docs/*.md: each that runs a megaloop entry point must
still work as written (its options, presets, config fields and values), checked without running
anything (tests/doc_commands.py). The slurm/ scripts' dry runs are tests/test_slurm.py's."""

import re

import pytest

from tests.doc_commands import (RUN_CONFIG_ENTRIES, commands_of, console_scripts,
                                documented_commands, is_field, problem)
from tests.docs import CODE_SPAN, FENCE, PAGES

COMMANDS = documented_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.where)
def test_documented_command_works(command):
    assert problem(command) is None, str(command)


def test_the_documented_entry_points_are_all_found():
    """The extraction misses none of the kinds of command the pages give."""
    found = {command.program[0] if command.program[0] != "module" else command.program[1]
             for command in COMMANDS}
    assert found >= {"tool", "pytest", "slurm", "console", "megaloop.train", "megaloop.quickstart"}
    assert len(COMMANDS) > 60


def test_every_console_script_is_checked():
    """megaloop-train's arguments are checked through megaloop.train.build_config; a console
    script added to setup.py needs its own way in here, or its commands would go unchecked."""
    assert set(console_scripts()) <= RUN_CONFIG_ENTRIES


PAGE = """# Commands

```bash
# a comment, then a command over two lines
megaloop-train --preset 135m model.arch=asymloop \\
    data.path='[data/x]' data.tokenizer_model=tok.model
megaloop-train --preset 135M train.learning_rate=1e-3 data.path=x data.tokenizer_model=t
megaloop-train --preset 135M train.lr=fast data.path=x data.tokenizer_model=t
megaloop-train --preset 135M model.arch=dense model.encoder_layers=2 data.path=x data.eod_id=0
torchrun --nproc-per-node 2 -m megaloop.train --config examples/configs/gone.yaml
torchrun --nproc-per-node 2 -m megaloop.train --config run.yaml parallel.tensor=2
megaloop-train --dry-run --world-size 0 data.path=x data.tokenizer_model=t
python tools/eval_gsm8k.py CKPT --test t --predictions p --num-iteration 5
python tools/bench/train_throughput.py --rows sparse
python tools/finetune_gsm8k.py --base b --data d --out o train.micro_batchsize=8
python tools/gone.py --x
bash tools/bootstrap.sh python -m pytest -q tests/test_docs.py tests/gone.py
sbatch slurm/gone.sh
```

A mention, `tools/eval_gsm8k.py --num-iteration`, and one that holds,
`tools/eval_gsm8k.py --num-iterations`; `OMP_NUM_THREADS=1 tools/bench/preprocess.py --scale 0`;
`python -m megaloop.gone`; `python tools/loss_compare.py --layouts single dp2 --preset ...
data.paths=...`; `python tools/bench/recompute.py --repeats 7`; `... --expert 8`; `ls tools/`.
"""


def test_a_command_that_would_not_work_is_found(tmp_path):
    """Each way a documented command goes stale, named in one line, at its page and line."""
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    expected = [  # the lines' openings: the rest lists presets, fields, options as the code has
        ("page.md:5", "--preset '135m': unknown; choose one of tiny, 60M, 135M"),
        ("page.md:7", "unknown field train.learning_rate (known: seed,"),
        ("page.md:8", "train.lr='fast': must be of type float"),
        ("page.md:9", "model.encoder_layers=2: must be left at its default None"),
        ("page.md:10", "--config examples/configs/gone.yaml: no such file in the repository"),
        ("page.md:11", None),  # the user's run.yaml: a placeholder naming data stands for it
        ("page.md:12", "megaloop-train: error: argument --world-size: 0: must be >= 1"),
        ("page.md:13", "tools/eval_gsm8k.py: no option --num-iteration"),  # cut short
        ("page.md:14", "train_throughput.py: error: argument --rows: invalid choice: 'sparse'"),
        ("page.md:15", "unknown field train.micro_batchsize (did you mean micro_batch_size?)"),
        ("page.md:16", "tools/gone.py: no such tool"),
        ("page.md:17", "no such test path: tests/gone.py"),
        ("page.md:18", "slurm/gone.sh: no such script"),
        ("page.md:21", "tools/eval_gsm8k.py: no option --num-iteration"),  # a mention
        ("page.md:22", None),
        ("page.md:22", "tools/bench/preprocess.py is not executable: run it with python"),
        ("page.md:23", "megaloop.gone: no such module"),
        ("page.md:23", "override 'data.paths=...': data.paths is not a config field"),
        ("page.md:24", None),
        ("page.md:24", "tools/bench/recompute.py: no option --expert"),  # `...`: recompute.py's
    ]
    found = [(command.where, problem(command)) for command in commands_of(page)]
    assert [(where, text and text[:len(opening or "")]) for (where, text), (_, opening)
            in zip(found, expected)] == expected
    assert len(found) == len(expected)


def test_a_field_named_in_the_prose_is_a_config_field():
    """`train.eval_depths=[1,3,5]`, `data.cache_dir`: every section.field in a code span of the
    pages names a field of the run config (values are not checked: prose gives placeholders and
    values the config refuses, to say so). File names (`model.safetensors`) are not fields."""
    named = set()
    for page in PAGES:
        for span in CODE_SPAN.finditer(FENCE.sub("", page.read_text())):
            for word in span.group().strip("`").split():
                match = re.fullmatch(r"((?:model|parallel|train|data|checkpoint|alrs)\.\w+"
                                     r"(?:\.\w+)*)(=.*)?", word.rstrip(",;:"))
                if match and not re.search(r"\.(safetensors|zarr|json|yaml|pt)$", match[1]):
                    named.add(match[1])
    assert len(named) > 50
    assert sorted(key for key in named if not is_field(key)) == []
