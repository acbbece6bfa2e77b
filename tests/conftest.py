"""Shared test set-up: deterministic seeds and a quiet, bounded thread pool."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
