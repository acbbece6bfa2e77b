"""Shared test set-up: every test starts from the same global seed."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
