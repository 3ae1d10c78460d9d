"""A command whose --help describes it by its module docstring gives the docstring's first
paragraph whole (before: its first line, cut short in ten of them: "Downstream accuracy of
a megaloop checkpoint or Hugging Face directory with the LM Evaluation")."""

import sys

import pytest

from tests.tool_scripts import TOOLS

SCRIPTS = sorted(str(path.relative_to(TOOLS).with_suffix(""))
                 for path in [*TOOLS.glob("*.py"), *TOOLS.glob("bench/*.py")])


def _words(text: str) -> str:
    return " ".join(text.split())


def _help_of(main, capsys, monkeypatch, name) -> str:
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    monkeypatch.setenv("COLUMNS", "1000")  # no word broken at a hyphen
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0
    return _words(capsys.readouterr().out)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_tool_help_opens_with_its_docstring_summary(load_tool, capsys, monkeypatch, script):
    module = load_tool(script)
    first_line, summary = (_words(module.__doc__.split(end)[0]) for end in ("\n", "\n\n"))
    text = _help_of(module.main, capsys, monkeypatch, script)
    assert summary in text or first_line not in text  # plot_*: a description of their own


@pytest.mark.parametrize("command", [*SCRIPTS, "megaloop.train", "megaloop.quickstart"])
def test_a_command_refuses_an_abbreviated_option(load_tool, capsys, monkeypatch, command):
    """--hel, as any option cut short. Before: taken for --help (argparse's allow_abbrev), as
    --output-pre was for --output-prefix, and a later option sharing the prefix changed its
    meaning; Megatron-LM's parsers refuse them too."""
    import importlib

    module = (importlib.import_module(command) if command.startswith("megaloop.")
              else load_tool(command))
    monkeypatch.setattr(sys, "argv", [command, "--hel"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2 and capsys.readouterr().out == ""


@pytest.mark.parametrize("name", ["megaloop.train", "megaloop.quickstart"])
def test_an_entry_point_help_opens_with_its_docstring_summary(capsys, monkeypatch, name):
    import importlib

    module = importlib.import_module(name)
    summary = _words(module.__doc__.split("\n\n")[0])
    assert summary in _help_of(module.main, capsys, monkeypatch, name)
