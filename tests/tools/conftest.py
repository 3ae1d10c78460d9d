"""tools/ scripts are not a package: tests load them as modules."""

import pytest

from tests.data.conftest import _load_tool


@pytest.fixture(scope="session")
def load_tool():
    return _load_tool
