"""One assembly for every use: a run's adapter, scored by ``squash_eval`` (with ``adapter_dir``,
and on the run's merged weights), gives the logits of the model the run trained, whatever its
``init`` and base.

The reference is the training recipe's own model after its last step. ``init: svd`` and
``loftq`` train on a residual base (the base minus what the adapter starts from), so an
evaluation that loads the original base under the trained adapter scores another model; the
test shows how far off that would be.
"""

import sys

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG, finetune_in_process

sys.path.insert(0, str(REPO / "recipes"))
import squash_eval  # noqa: E402

from squash.assembly.model_setup import setup_frozen_model  # noqa: E402
from squash.config.keys import ConfigKeyError  # noqa: E402
from squash.runs import checkpoint as ckpt  # noqa: E402

EVAL = REPO / "configs" / "opt_tiny_eval.yaml"
OUTLIERS = {"fraction": 0.02, "criterion": "magnitude"}
CASES = {
    "lora": {},
    "svd": {"model.init": "svd"},
    "loftq": {"model.init": "loftq"},
    "lora_outliers": {"model.base_outliers": OUTLIERS},
    "svd_outliers": {"model.init": "svd", "model.base_outliers": OUTLIERS},
}


def _cfg(path, out, **changes):
    cfg = OmegaConf.load(path)
    cfg.output_dir = str(out)
    cfg.device, cfg.dtype = "cpu", "fp32"  # the comparisons' tolerances are fp32's
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _train(out, changes):
    """Three steps of the tiny OPT at a rate that moves the adapter; the recipe's own model
    after them (the reference) and the checkpoint directory."""
    cfg = _cfg(TINY_CONFIG, out, epochs=1, max_steps_per_epoch=3, batch_size=4,
               **{"optimizer.lr": 1e-2}, **changes)  # fmt: skip
    recipe = finetune_in_process(cfg)
    return recipe._model.eval(), out / "epoch_0"


def _logits(model, tokens):
    out = model(tokens)  # a training recipe's model gives its logits in chunks
    return torch.cat(out, dim=1) if isinstance(out, list) else out


def _eval_recipe(out, **changes):
    cfg = _cfg(EVAL, out, **changes)
    recipe = squash_eval.SquashEvalRecipe(cfg)
    recipe.setup(cfg)
    return recipe


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    recipe = _eval_recipe(tmp_path_factory.mktemp("base_eval"))  # the base alone: only its data loader is used
    batch = next(iter(recipe._dataloader))
    return batch["tokens"][:4]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_squash_eval_scores_the_model_the_run_trained(case, tokens, tmp_path):
    trained, epoch = _train(tmp_path / "run", CASES[case])
    with torch.no_grad():
        reference = _logits(trained, tokens)
        base_only = setup_frozen_model(OmegaConf.load(EVAL).model, _base(tmp_path),
                                       device=torch.device("cpu"), dtype=torch.float32)
        base_only = _logits(base_only, tokens)
    assert (reference - base_only).abs().max() > 1e-2  # the adapter trained: it changes logits

    # squash_eval with adapter_dir: the eval config restates none of init/base_outliers
    recipe = _eval_recipe(tmp_path / "eval", adapter_dir=str(epoch))
    with torch.no_grad():
        scored = _logits(recipe._model, tokens)
    torch.testing.assert_close(scored, reference, rtol=0, atol=1e-5)

    # the other path: the run's model block restated in full, the original base loaded under
    # the trained adapter; right for init: lora (corrected base or not), not for a residual base
    block = _cfg(TINY_CONFIG, tmp_path, **CASES[case]).model
    model = setup_frozen_model(block, _base(tmp_path), device=torch.device("cpu"),
                               dtype=torch.float32)  # fmt: skip
    ckpt.load_adapter_into(model, ckpt.load_squash_adapter(epoch), epoch)
    with torch.no_grad():
        off = (_logits(model, tokens) - reference).abs().max().item()
    if CASES[case].get("model.init") in ("svd", "loftq"):  # >= 10x the right path's tolerance
        assert off > 1e-4, off  # tiny OPT, loftq: 7e-4 (NF4(W - A0 B0) against NF4(W))
    else:
        assert off < 1e-5, off

    # the merged weights the run wrote (save_adapter_weights_only: False), as a plain model
    merged = _eval_recipe(tmp_path / "merged", **{"checkpointer.checkpoint_dir": str(epoch),
                                                  "model.quantize_base": False})  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(_logits(merged._model, tokens), reference, rtol=0, atol=2e-4)


def _base(scratch):
    from squash.models.opt import OPTCheckpointer

    tiny = REPO / "assets" / "tiny_opt"
    return OPTCheckpointer(str(tiny), ["model.safetensors"], str(scratch)).load_checkpoint()["model"]


@pytest.mark.slow
def test_an_eval_config_that_contradicts_the_run_is_refused(tmp_path):
    _, epoch = _train(tmp_path / "run", CASES["svd"])
    with pytest.raises(ConfigKeyError, match=r"^model\.init: the adapter in .*epoch_0 was "
                                              r"trained with 'svd', the config says 'lora'"):
        _eval_recipe(tmp_path / "eval", adapter_dir=str(epoch), **{"model.init": "lora"})
    with pytest.raises(ConfigKeyError, match=r"^model\.lora_rank: .* trained with 32, the "
                                              r"config says 16"):
        _eval_recipe(tmp_path / "eval2", adapter_dir=str(epoch), **{"model.lora_rank": 16})
