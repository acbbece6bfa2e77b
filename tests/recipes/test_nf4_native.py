"""squash's native NF4 path (squash.nf4.nf4_linear) trains as torchao's linear_nf4 does: the
losses of a short fp32 QLoRA run agree with those of the same run under SQUASH_NF4=torchao."""

import pytest

from tests.helpers import logged

FOUR = ["epochs=1", "max_steps_per_epoch=4", "dtype=fp32"]


@pytest.mark.slow
def test_native_nf4_losses_equal_torchao_losses(run, tmp_path):
    run(tmp_path / "native", *FOUR, env={"SQUASH_NF4": "native"})
    run(tmp_path / "torchao", *FOUR, env={"SQUASH_NF4": "torchao"})
    native, torchao = logged(tmp_path / "native"), logged(tmp_path / "torchao")
    assert sorted(native) == [1, 2, 3, 4] and sorted(torchao) == [1, 2, 3, 4]
    for step in native:
        assert native[step] == pytest.approx(torchao[step], rel=1e-6, abs=1e-6), step


@pytest.mark.slow
def test_squash_qlora_recipe_trains_exactly_as_with_torchao(run, tmp_path):
    """squash's dense QLoRA (qlora_opt_tiny: NF4LoRALinear, squash's NF4 kernel) gives the very
    same losses as torchtune's LoRALinear computing its base with torchao's linear_nf4."""
    qlora = ["model._component_=squash.models.opt.qlora_opt_tiny", "~model.sparsity",
             "~model.sparse_factor", "~mask_update"]  # fmt: skip
    run(tmp_path / "native", *FOUR, *qlora, env={"SQUASH_NF4": "native"})
    run(tmp_path / "torchao", *FOUR, *qlora, env={"SQUASH_NF4": "torchao"})
    native, torchao = logged(tmp_path / "native"), logged(tmp_path / "torchao")
    assert sorted(native) == [1, 2, 3, 4] and native == torchao
