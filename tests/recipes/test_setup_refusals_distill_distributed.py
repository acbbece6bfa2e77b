"""squash_distill and squash_finetune_distributed stop in set-up as squash_finetune does: a bad
model value (refused by the value checks or by the model's builder) is one line naming the key,
and the output directory is left as it was (absent if it was absent, byte-identical otherwise:
no log, no torchtune_config.yaml, no teacher checkpointer directory). In-process through the
distillation recipe's class, and for real through ``tune run``."""

import shutil
import sys

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, declare_dtype, tree, tune_run

sys.path.insert(0, str(REPO / "recipes"))
import squash_distill  # noqa: E402

from squash.config.keys import ConfigKeyError  # noqa: E402

TINY = REPO / "assets" / "tiny_opt"
DISTILL = REPO / "configs" / "opt_tiny_distill.yaml"
DISTRIBUTED = REPO / "configs" / "opt_tiny_distributed.yaml"
ATTN = ("model (squash.models.opt.squash_opt_tiny): lora_attn_modules must be a non-empty subset "
        "of ['q_proj', 'k_proj', 'v_proj', 'output_proj'], got ['nope']")  # fmt: skip


def _distill(out, key, value):
    cfg = OmegaConf.load(DISTILL)
    cfg.output_dir = str(out)
    cfg.device, cfg.dtype = "cpu", "fp32"  # as tests.helpers.QUICK: the CPU in fp32 on any host
    OmegaConf.update(cfg, key, value, force_add=True)
    recipe = squash_distill.SquashDistillRecipeSingleDevice(cfg)
    try:
        recipe.setup(cfg)
    finally:
        recipe.cleanup()


@pytest.mark.parametrize("key, value, message", [
    ("model.lora_rank", -1, "model.lora_rank must be an integer >= 1, got -1"),
    ("model.sparsity", 1.5, "model.sparsity must be a number in [0, 1), got 1.5"),
    ("model.sparse_factor", "c", "model.sparse_factor must be one of a, b, both, got 'c'"),
    ("model.lora_attn_modules", ["nope"], ATTN),  # refused by the builder
    ("tokenizer.max_seq_len", 1, None),  # refused after both checkpointers are made
])  # fmt: skip
@pytest.mark.parametrize("existing", [False, True])
def test_distill_refuses_in_one_line_and_leaves_output_dir_as_it_was(tmp_path, key, value, message,
                                                                     existing):
    out = tmp_path / "new" / "out"
    if existing:  # a directory of the user's: kept byte for byte, nothing added
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("mine\n")
        (out / "empty").mkdir()
    before = tree(tmp_path / "new")
    with pytest.raises(ConfigKeyError) as info:
        _distill(out, key, value)
    text = str(info.value)
    assert "\n" not in text
    if message is not None:
        assert text == message
    else:
        assert text.startswith("tokenizer.max_seq_len=1 leaves no token to train on")
    assert tree(tmp_path / "new") == before


def test_distill_checks_the_teacher_s_weights_dtype_before_loading_them(tmp_path):
    """The teacher's checkpointer is checked as the student's: F16 data declared BF16 against a
    config.json that says float16 is one line naming teacher_checkpointer and the file."""
    teacher = tmp_path / "teacher"
    shutil.copytree(TINY, teacher)
    first = declare_dtype(teacher / "model.safetensors", "F16", "BF16")
    out = tmp_path / "new" / "out"
    with pytest.raises(ConfigKeyError) as info:
        _distill(out, "teacher_checkpointer.checkpoint_dir", str(teacher))
    assert str(info.value) == (
        f"teacher_checkpointer.checkpoint_files: {teacher / 'model.safetensors'} declares {first} "
        f"as BF16, but {teacher / 'config.json'} says float16: the weights would be read as the "
        "wrong type; fix the file or its config.json"
    )
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_tune_run_distill_refuses_a_model_its_builder_refuses_in_one_line(tmp_path):
    out = tmp_path / "new" / "out"
    proc = tune_run(out, "model.lora_attn_modules=[nope]", recipe="squash_distill",
                    config=DISTILL, check=False)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"squash_distill: config error: {ATTN}"
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    ("model.sparsity=1.5", "model.sparsity must be a number in [0, 1), got 1.5"),
    ("model.lora_attn_modules=[nope]", ATTN),
])
def test_tune_run_distributed_refuses_a_bad_model_value_in_one_line(tmp_path, override, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    before = tree(out)
    proc = tune_run(out, override, recipe="squash_finetune_distributed", config=DISTRIBUTED,
                    nproc=1, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert f"squash_finetune_distributed: config error: {message}\n" in proc.stderr
    assert "Traceback" not in proc.stderr.split("squash_finetune_distributed: config error")[0]
    assert tree(out) == before
