"""The bytes of a corrected base's outlier matrix ``S`` (``model.base_outliers``) in the memory
accounting and in the run's model summary, checked against a hand count of the modules' own
``outlier_values`` / ``outlier_indices`` buffers (``numel * element_size``)."""

import logging

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.models.llama3_2._component_builders import llama3_2

from squash.assembly.model_setup import assemble_adapter_model
from squash.training.memory import base_memory, outlier_memory
from tests.models.test_one_pass import TINY

OUTLIERS = {"fraction": 0.05, "criterion": "magnitude"}


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in llama3_2(**TINY).state_dict().items()}


def _cfg(outliers=None):
    block = {"_component_": "tests.models.test_one_pass.tiny_squash_smollm2",
             "lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8,
             "sparsity": 0.75, "base_outliers": outliers}  # fmt: skip
    return OmegaConf.create(block)


def _assemble(base, outliers):
    return assemble_adapter_model(_cfg(outliers), base, device=torch.device("cpu"),
                                  dtype=torch.float32, seed=1).model  # fmt: skip


def _hand_count(model):
    """``{module: bytes}`` of the module's outlier buffers, read off ``named_buffers``."""
    counts = {}
    for name, buf in model.named_buffers():
        module, _, leaf = name.rpartition(".")
        if leaf in ("outlier_values", "outlier_indices"):
            counts[module] = counts.get(module, 0) + buf.numel() * buf.element_size()
    return counts


def test_outlier_bytes_are_the_modules_buffers_and_the_base_counts_them(base):
    plain, corrected = _assemble(base, None), _assemble(base, OUTLIERS)
    hand = _hand_count(corrected)
    assert len(hand) == 14 and all(hand.values())  # 7 NF4 projections x 2 layers
    assert outlier_memory(corrected) == hand and outlier_memory(plain) == {}
    # NF4(W - S) has the bytes of NF4(W): the corrected base costs S on top, nothing else
    assert base_memory(corrected) - base_memory(plain) == sum(hand.values())


def test_a_model_not_yet_loaded_counts_the_outliers_it_will_hold(base):
    corrected = _assemble(base, OUTLIERS)
    torch.manual_seed(0)
    unloaded = config.instantiate(_cfg(OUTLIERS))  # built, S still empty
    assert _hand_count(unloaded) == {}
    assert outlier_memory(unloaded) == _hand_count(corrected)
    assert base_memory(unloaded) == base_memory(corrected)


def test_the_model_summary_logs_the_outlier_bytes(base, caplog):
    with caplog.at_level(logging.INFO):
        model = _assemble(base, OUTLIERS)
    hand = sum(_hand_count(model).values())
    want = f"frozen base {base_memory(model):,} bytes, {hand:,} of them the FFI outliers S of 14"
    assert want in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _assemble(base, None)
    assert "trainable parameters" in caplog.text and "outliers S" not in caplog.text
