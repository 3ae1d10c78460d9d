"""The megaloop commands that README.md and docs/*.md give, and whether each still works as written,
checked without running it: a tool's own argparse parser (tools/*.py, python -m megaloop.*) parses
the arguments and stops there; megaloop-train's arguments go through megaloop.train.build_config,
which loads and validates the run config as a launch does, before anything is built.

A command is a line of a ```bash block or an inline code span that starts with an interpreter, a
launcher or an environment assignment; an inline span that starts with the tool itself
(`tools/eval_gsm8k.py --tokenizer`) is a mention: its options must be the tool's, its preset and
overrides real, but it need not be whole. Placeholders are taken as the words they are (paths need
not exist; the parsers do not open them): `[--limit 100]` is an optional part, given; a bare `...`
means "more arguments", or a value after an option; a `--config` file that is not in the
repository (`run.yaml`) is the user's, and stands for a config naming some data."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from tests.docs import CODE_SPAN, FENCE, PAGES, REPO
from tests.tool_scripts import load_tool

SHELL_BLOCK = re.compile(r"^(```|~~~)(bash|sh|shell|console)\n(.*?)^\1", re.S | re.M)
OPTION = re.compile(r"--?[A-Za-z]")  # not a negative number
ENVIRONMENT = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")  # OMP_NUM_THREADS=1 before a command
PYTHON = ("python", "python3")
# Entry points whose arguments make a run config: megaloop.train's build_config validates it.
RUN_CONFIG_ENTRIES = {"megaloop-train", "megaloop.train"}
# What a config file the page does not show stands for: a run needs data and its tokenizer.
PLACEHOLDER_CONFIG = "data:\n  path: [placeholder]\n  tokenizer_model: placeholder.model\n"


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    text: str  # as the page gives it, lines joined
    program: tuple[str, str]  # ("tool", "bench/step_time"), ("module", "megaloop.quickstart"),
    # ("console", "megaloop-train"), ("pytest", ""), ("slurm", "slurm/x.sh")
    args: tuple[str, ...]
    mention: bool  # an inline span naming the tool: not necessarily a whole command
    direct: bool  # the script run as a program (no interpreter before it)
    incomplete: bool  # "..." stands for more arguments

    def __str__(self):
        return f"{self.where}: {self.text}"


@functools.cache
def console_scripts() -> dict[str, str]:
    """setup.py's console scripts: name -> module:function."""
    return dict(re.findall(r"[\"']([\w-]+)=([\w.]+:\w+)[\"']", (REPO / "setup.py").read_text()))


def _words(text: str) -> list[str] | None:
    """The shell words of ``text`` with [optional] groups given; None where it is not shell."""
    text = re.sub(r"(?<!\S)\[([^\[\]]*)\]", r"\1", text)
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return None


def _entry(words: list[str]) -> tuple[tuple[str, str], list[str], bool, bool] | None:
    """(program, its arguments, launched, direct) of a command line; None for a command that runs
    no megaloop entry point. ``launched``: an interpreter, launcher or environment came first."""
    i, launched = 0, False
    while i < len(words):
        word = words[i]
        if ENVIRONMENT.fullmatch(word):
            i, launched = i + 1, True
        elif word == "nice" and words[i + 1:i + 2] == ["-n"]:
            i, launched = i + 3, True
        elif word == "bash" and words[i + 1:i + 2] == ["tools/bootstrap.sh"]:
            i, launched = i + 2, True
        elif word in ("torchrun", "mpiexec", "mpirun", "srun"):  # to its program
            i, launched = i + 1, True
            while i < len(words) and not (words[i] in (*PYTHON, "-m", *console_scripts())
                                          or words[i].endswith(".py")):
                i += 1
            if words[i:i + 1] == ["-m"]:
                return ("module", words[i + 1]), words[i + 2:], True, False
        else:
            break
    words = words[i:]
    if not words:
        return None
    head = words[0]
    if head in PYTHON:
        rest = words[1:]
        while rest and re.fullmatch(r"-[IStuOBE]+", rest[0]):  # the interpreter's own flags
            rest = rest[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            if rest[1] == "pytest":
                return ("pytest", ""), rest[2:], True, False
            if rest[1].split(".")[0] == "megaloop":
                return ("module", rest[1]), rest[2:], True, False
            return None
        if rest and rest[0].endswith(".py"):
            return _script(rest[0]), rest[1:], True, False
        return None
    if head in console_scripts():
        return ("console", head), words[1:], launched, False
    if head.endswith(".py"):
        program = _script(head)
        return (program, words[1:], launched, True) if program else None
    if head in ("bash", "sh", "sbatch") and len(words) > 1 and words[1].startswith("slurm/"):
        return ("slurm", words[1]), words[2:], True, False
    return None


def _script(path: str) -> tuple[str, str] | None:
    """("tool", its name for load_tool) of tools/<name>.py, or of a bare name that is a tool's
    (preprocess_data.py); None for another script."""
    match = re.fullmatch(r"(?:\./)?tools/(.+)\.py", path)
    if match:
        return ("tool", match.group(1))
    if "/" not in path and (REPO / "tools" / path).is_file():
        return ("tool", path.removesuffix(".py"))
    return None


def _command(where: str, text: str, *, span: bool, previous: Command | None) -> Command | None:
    words = _words(" ".join(text.split()))
    if not words:
        return None
    if words[0] == "..." and previous is not None and span:  # `...` continuing the last command
        return Command(where, text, previous.program, tuple(words[1:]), previous.mention,
                       previous.direct, True)
    found = _entry(words)
    if found is None:
        return None
    program, args, launched, direct = found
    incomplete = "..." in args
    # "..." after an option stands for its value; elsewhere for more arguments.
    args = [a for i, a in enumerate(args) if a != "..." or (i and args[i - 1].startswith("-"))]
    # A span naming megaloop-train alone names it: without arguments it has no data to train on.
    mention = span and (not launched or (not args and program[1] in RUN_CONFIG_ENTRIES))
    return Command(where, text, program, tuple(args), mention, direct, incomplete)


def documented_commands() -> list[Command]:
    """Every command of README.md and docs/*.md that runs a megaloop entry point."""
    return [command for page in PAGES for command in commands_of(page)]


def commands_of(page: Path) -> list[Command]:
    """The commands of one page that run a megaloop entry point, blocks first, then spans."""
    commands = []
    text = page.read_text()
    for block in SHELL_BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(3)) + 1
        lines, i = block.group(3).split("\n"), 0
        while i < len(lines):
            number, line = first + i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):  # a continued line
                i += 1
                line = line[:-1] + " " + lines[i]
            i += 1
            command = _command(f"{page.name}:{number}", line, span=False, previous=None)
            if command:
                commands.append(command)
    # Spans outside the fences; the fences blanked, not cut, so that offsets give lines.
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    previous = None
    for span in CODE_SPAN.finditer(prose):
        content = span.group().strip("`")
        where = f"{page.name}:{text.count(chr(10), 0, span.start()) + 1}"
        command = _command(where, content, span=True, previous=previous)
        if command:
            commands.append(command)
        previous = command
    return commands


# ------------------------------------------------------------------------------ parsing only

class _Parsed(Exception):
    """Raised by a parser in place of returning: the command is parsed, not run."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace | None):
        super().__init__()
        self.parser, self.namespace = parser, namespace


def _stopping(method, parse: bool):
    def stop(self, args=None, namespace=None):
        raise _Parsed(self, method(self, args, namespace) if parse else None)
    return stop


def _run_until_parsed(main, program: str, argv: list[str], parse: bool = True) -> _Parsed | str:
    """Runs ``main`` (an entry point's, reading sys.argv) as ``program`` with ``argv`` up to its
    parse_args / parse_intermixed_args, which raises what it parsed (``parse=False``: before
    parsing, for the parser alone); or argparse's error line."""
    cls = argparse.ArgumentParser
    stderr = io.StringIO()
    try:
        with mock.patch.object(cls, "parse_args", _stopping(cls.parse_args, parse)), \
                mock.patch.object(cls, "parse_intermixed_args",
                                  _stopping(cls.parse_intermixed_args, parse)), \
                mock.patch.object(sys, "argv", [program, *argv]), \
                contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            main()
    except _Parsed as parsed:
        return parsed
    except SystemExit as e:
        if e.code == 0:  # --help
            return _Parsed(None, None)
        lines = stderr.getvalue().strip().splitlines()
        return lines[-1] if lines else f"exit {e.code}"
    raise AssertionError(f"{main} returned without parsing its arguments")


def _main_of(command: Command):
    kind, name = command.program
    if kind == "tool":
        return load_tool(name).main
    if name in RUN_CONFIG_ENTRIES:
        from megaloop.train import build_config

        return lambda: build_config(sys.argv[1:])
    return importlib.import_module(name).main


def _shown(command: Command) -> str:
    """The program's name in its usage lines."""
    kind, name = command.program
    return f"tools/{name}.py" if kind == "tool" else name


def _options(parser: argparse.ArgumentParser, args: tuple[str, ...]) -> set[str]:
    """The option strings ``args`` may use: the parser's and those of a subcommand it names."""
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for arg in args:
                if arg in action.choices:
                    options |= _options(action.choices[arg], args)
    return options


def _run_settings(preset, config, overrides) -> str | None:
    """The --preset, --config and section.field=value overrides of a tool that takes megaloop-
    train's: the preset exists, the file loads, each override names a field and a value it takes
    (the run as a whole, with its data, is the tool's to check)."""
    from megaloop.config import ConfigError, RunConfig, apply_overrides, load_yaml
    from megaloop.presets import PRESETS

    for override in overrides:  # "data.path=...": a value left to the user, of a real field
        key, _, value = override.partition("=")
        if value == "..." and not is_field(key):
            return f"override {override!r}: {key} is not a config field"
    overrides = [o for o in overrides if o.partition("=")[2] != "..."]
    if preset not in (None, "...") and preset not in PRESETS:
        return f"--preset {preset}: no such preset ({', '.join(PRESETS)})"
    try:
        cfg = RunConfig(model=PRESETS[preset]) if preset in PRESETS else RunConfig()
        if config and (REPO / config).is_file():
            cfg = load_yaml(REPO / config, base=cfg)
        apply_overrides(cfg, list(overrides))
    except ConfigError as e:
        return str(e)
    return None


def is_field(key: str) -> bool:
    """Whether ``key`` (train.lr, train.profile.steps) names a field of the run config."""
    from megaloop.config import RunConfig
    from megaloop.config.serialization import to_dict

    node = to_dict(RunConfig())
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _is_override(word: str) -> bool:
    key = word.partition("=")[0]
    return "=" in word and re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key) is not None


def _value_after(args: tuple[str, ...], option: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(option + "="):
            return arg.partition("=")[2]
    return None


def _config_file(path: str, scratch: Path) -> tuple[str | None, str | None]:
    """(the file to read for ``--config path``, or a problem): the repository's file (one under
    its folders must be there), else the user's own, for which a placeholder stands."""
    if (REPO / path).is_file():
        return str(REPO / path), None
    if "/" in path and (REPO / path.split("/")[0]).is_dir():
        return None, f"--config {path}: no such file in the repository"
    placeholder = scratch / "user_config.yaml"
    placeholder.write_text(PLACEHOLDER_CONFIG)
    return str(placeholder), None


def _run_config_problem(command: Command) -> str | None:
    """megaloop-train's arguments through build_config: parsed, the run config loaded,
    overridden and validated, as a launch does before building anything."""
    from megaloop.config import ConfigError
    from megaloop.train import build_config

    args = list(command.args)
    stderr = io.StringIO()
    with tempfile.TemporaryDirectory() as scratch:
        config = _value_after(command.args, "--config")
        if config is not None:
            path, refusal = _config_file(config, Path(scratch))
            if refusal:
                return refusal
            args[args.index(config)] = path
        elif command.incomplete:  # "...": the rest of a run, which names its data
            placeholder = Path(scratch) / "rest.yaml"
            placeholder.write_text(PLACEHOLDER_CONFIG)
            args += ["--config", str(placeholder)]
        try:
            with contextlib.redirect_stderr(stderr):
                build_config(args)
        except SystemExit as e:  # argparse's usage error
            lines = stderr.getvalue().strip().splitlines()
            return lines[-1] if lines else f"exit {e.code}"
        except ConfigError as e:
            return str(e)
    return None


def problem(command: Command) -> str | None:
    """Why ``command`` would not work as the page gives it (one line), or None."""
    kind, name = command.program
    if kind == "pytest":
        missing = [a for a in command.args if a.startswith("tests") and not
                   (REPO / a.split("::")[0]).exists()]
        return f"no such test path: {' '.join(missing)}" if missing else None
    if kind == "slurm":
        return None if (REPO / name).is_file() else f"{name}: no such script"
    if kind == "tool" and not (REPO / "tools" / f"{name}.py").is_file():
        return f"tools/{name}.py: no such tool"
    if kind == "module" and importlib.util.find_spec(name) is None:
        return f"{name}: no such module"
    if command.direct and not command.mention:
        script = REPO / "tools" / f"{name}.py"
        if not (os.access(script, os.X_OK) and script.read_text().startswith("#!")):
            return f"{script.relative_to(REPO)} is not executable: run it with python"
    # Options by their full names: the tools refuse an abbreviation (--num-iteration), as
    # argparse's allow_abbrev=False does; a mention's options must be the tool's.
    parser = _run_until_parsed(_main_of(command), _shown(command), [], parse=False).parser
    options = _options(parser, command.args)
    unknown = [a for a in command.args if OPTION.match(a) and a.split("=")[0] not in options]
    if unknown:
        return f"{_shown(command)}: no option {' '.join(unknown)}"
    if command.mention:
        return _run_settings(_value_after(command.args, "--preset"), None,
                             [a for a in command.args if _is_override(a)])
    if name in RUN_CONFIG_ENTRIES:
        return _run_config_problem(command)
    parsed = _run_until_parsed(_main_of(command), _shown(command), list(command.args))
    if isinstance(parsed, str):
        return parsed
    namespace = parsed.namespace or argparse.Namespace()
    return _run_settings(getattr(namespace, "preset", None), getattr(namespace, "config", None),
                         getattr(namespace, "overrides", None) or [])
