"""The user documentation, README.md and the pages under docs/, for the tests that hold the code to
what it says."""

import re
from pathlib import Path

REPO = Path(__file__).parents[1]
README = REPO / "README.md"
PAGES = (README, *sorted((REPO / "docs").glob("*.md")))
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)  # a fenced code block, whole
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)  # an inline `code` span


def documentation() -> str:
    """Every page's text, README first, so that a test finding a command or a snippet in it does not
    depend on which page holds it."""
    return "\n\n".join(page.read_text() for page in PAGES)
