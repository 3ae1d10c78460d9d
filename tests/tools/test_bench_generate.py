"""tools/bench/generate.py refuses settings that would time nothing (before: --new-tokens 1
printed rates of zero tokens and exited 0; --repeats 0 failed after building the models)."""

import pytest

from tests.tool_scripts import load_tool


@pytest.mark.parametrize("flag, value, minimum", [("--new-tokens", "1", 2), ("--repeats", "0", 1),
                                                  ("--prompt", "0", 1), ("--batch", "0", 1),
                                                  ("--iterations", "0", 1)])
def test_settings_that_time_nothing_are_refused_in_one_line(flag, value, minimum, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_tool("bench/generate").main([flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {value}: must be >= {minimum}" in capsys.readouterr().err
