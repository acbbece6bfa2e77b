"""The recipes' shared set-up pieces (squash.training.data, .steps), against hand-computed values
and torchtune's own scheduler stepped by hand."""

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from squash.config.keys import ConfigKeyError
from squash.training import data, steps


def test_steps_per_epoch_is_whole_accumulations_capped():
    assert data.steps_per_epoch(10, batch_size=4, grad_accum=3, max_steps_per_epoch=None) == 3
    assert data.steps_per_epoch(10, batch_size=4, grad_accum=3, max_steps_per_epoch=2) == 2
    assert data.steps_per_epoch(10, batch_size=4, grad_accum=1, max_steps_per_epoch=50) == 10


def test_steps_per_epoch_refuses_an_epoch_without_a_step():
    with pytest.raises(ConfigKeyError, match=r"2 batches of batch_size=4 make no optimizer step "
                                             r"with gradient_accumulation_steps=3"):
        data.steps_per_epoch(2, batch_size=4, grad_accum=3, max_steps_per_epoch=None)
    with pytest.raises(ConfigKeyError, match="batch_size=4 per rank make no optimizer step"):
        data.steps_per_epoch(2, batch_size=4, grad_accum=3, max_steps_per_epoch=None,
                            per_rank=True)


def _optimizer(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_lr_scheduler_starts_at_the_step_after_global_step():
    cfg = OmegaConf.create({
        "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "num_warmup_steps": 3,
    })
    assert steps.setup_lr_scheduler(None, _optimizer(), num_training_steps=20, global_step=0) is None
    for done in (0, 2, 7):
        by_hand = _optimizer()
        sched = get_cosine_schedule_with_warmup(by_hand, num_warmup_steps=3, num_training_steps=20)
        for _ in range(done):
            by_hand.step()
            sched.step()
        opt = _optimizer()
        if done:  # a resumed run loads the optimizer's state first, as the recipes do
            opt.load_state_dict(by_hand.state_dict())
        steps.setup_lr_scheduler(cfg, opt, num_training_steps=20, global_step=done)
        assert opt.param_groups[0]["lr"] == pytest.approx(by_hand.param_groups[0]["lr"], abs=1e-12)


def test_lr_scheduler_restores_a_saved_state():
    cfg = OmegaConf.create({
        "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "num_warmup_steps": 3,
    })
    opt = _optimizer()
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=20)
    for _ in range(5):
        opt.step()
        sched.step()
    state = {"lr_scheduler": sched.state_dict()}
    resumed = _optimizer()
    resumed.load_state_dict(opt.state_dict())
    restored = steps.setup_lr_scheduler(cfg, resumed, num_training_steps=20, global_step=5,
                                      state=state)
    assert restored.state_dict()["last_epoch"] == 5
    assert restored.get_last_lr() == pytest.approx(sched.get_last_lr())
