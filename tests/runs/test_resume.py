"""The resume checks: a config change that breaks exactness is refused unless overridden; an
optimizer state that does not fit the model is named."""

import logging

import pytest
import torch
from omegaconf import OmegaConf

from squash.runs import resume

SAVED = {
    "output_dir": "/a", "batch_size": 4, "seed": 1, "epochs": 2,
    "optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.01},
    "metric_logger": {"log_dir": "/a/logs"}, "checkpointer": {"output_dir": "/a", "checkpoint_dir": "m"},
    "save_every_n_steps": 3, "model": {"sparsity": 0.9},
}


def _cfg(**changes):
    cfg = OmegaConf.create(SAVED)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_free_keys_may_change_and_others_are_listed_with_both_values():
    cfg = _cfg(**{"output_dir": "/b", "metric_logger.log_dir": "/b/logs", "checkpointer.output_dir": "/b",
                  "save_every_n_steps": 5, "keep_last_n": 1, "resume_from_checkpoint": True})
    assert resume.config_changes(SAVED, OmegaConf.to_container(cfg)) == []
    cfg = _cfg(**{"batch_size": 8, "optimizer.lr": 0.02, "model.sparsity": 0.8, "gradient_accumulation_steps": 2})
    assert resume.config_changes(SAVED, OmegaConf.to_container(cfg)) == [
        ("batch_size", 4, 8), ("gradient_accumulation_steps", None, 2), ("model.sparsity", 0.9, 0.8),
        ("optimizer.lr", 0.01, 0.02),
    ]


def test_a_changed_batch_size_is_refused_naming_the_override_key_which_accepts_it(tmp_path, caplog):
    with pytest.raises(ValueError, match=r"batch_size: 4 in the checkpoint, 8 now.*"
                                         r"resume_allow_config_change=True"):
        resume.check_config(tmp_path, SAVED, _cfg(batch_size=8))
    with caplog.at_level(logging.WARNING, logger="squash.runs.resume"):
        resume.check_config(tmp_path, SAVED, _cfg(batch_size=8, resume_allow_config_change=True))
    assert "batch_size: 4 in the checkpoint, 8 now" in caplog.text
    resume.check_config(tmp_path, SAVED, _cfg())  # unchanged: nothing to say


def test_a_checkpoint_without_a_recorded_config_needs_the_override(tmp_path):
    with pytest.raises(ValueError, match="records no run config.*resume_allow_config_change"):
        resume.check_config(tmp_path, None, _cfg())
    resume.check_config(tmp_path, None, _cfg(resume_allow_config_change=True))


def test_an_optimizer_moment_of_the_wrong_shape_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(3, 13))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    resume.check_optimizer_state(model, opt, "ckpt")
    state["state"][1]["exp_avg"] = torch.zeros(3)  # the bias is (13,)
    opt.load_state_dict(state)  # torch accepts it
    with pytest.raises(ValueError, match=r"ckpt/recipe_state.pt: the optimizer's 'exp_avg' of 0.bias "
                                         r"has shape \(3,\), the parameter \(13,\)"):
        resume.check_optimizer_state(model, opt, "ckpt")
