"""Fixtures of the recipe tests (the helpers they use are in tests/helpers.py)."""

import pytest

from tests.helpers import tune_run


@pytest.fixture
def run():
    return tune_run
