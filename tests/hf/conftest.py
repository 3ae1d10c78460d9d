"""Fixtures of the conversion tests."""

import pytest

from tests.hf.exports import Exports


@pytest.fixture(scope="session")
def exports(mcore, tmp_path_factory):
    from megaloop.hf.common import quiet_transformers

    quiet_transformers()
    return Exports(tmp_path_factory.mktemp("exports"))
