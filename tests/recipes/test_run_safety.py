"""Nothing lost, nothing silently wrong: the recipes never write into what they read, own their
output_dir, refuse a checkpoint that is not what was written, and refuse a resume with a config
that would not reproduce the run. Most cases raise in ``setup`` before any model is built, so
they run in-process; the overlap and the two concurrent runs go through the real ``tune run``."""

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import (
    QUICK, REPO, TINY_CONFIG, TUNE, finetune_in_process, rehash_checkpoint, tune_run,
)

sys.path.insert(0, str(REPO / "recipes"))
import squash_eval  # noqa: E402
import squash_finetune  # noqa: E402

from squash.config.keys import ConfigKeyError  # noqa: E402
from squash.runs import manifest  # noqa: E402
from squash.runs.manifest import CheckpointIntegrityError  # noqa: E402

TINY = REPO / "assets" / "tiny_opt"
EVAL_CONFIG = REPO / "configs" / "opt_tiny_eval.yaml"


def _cfg(out, path=TINY_CONFIG, **changes):
    cfg = OmegaConf.load(path)
    cfg.output_dir = str(out)
    cfg.device, cfg.dtype = "cpu", "fp32"  # as tests.helpers.QUICK: the CPU in fp32 on any host
    cfg.batch_size = 4
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _setup(cfg, recipe_cls=squash_finetune.SquashFinetuneRecipeSingleDevice):
    recipe = recipe_cls(cfg)
    try:
        recipe.setup(cfg)
    finally:
        recipe.cleanup()
    return recipe


def _tree(path):
    """``{relative path: sha256}`` of every file under ``path`` (and every directory, as None)."""
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(Path(path).rglob("*"))
    }


KEYS = dict(epochs=2, max_steps_per_epoch=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run (one step an epoch): epoch_0 and epoch_1, with merged weights."""
    out = tmp_path_factory.mktemp("trained") / "out"
    cfg = _cfg(out, **KEYS)
    recipe = finetune_in_process(cfg)
    assert not (out / ".squash-run.lock").exists()  # released at cleanup
    return out


# ---- 1. never write into what is read -------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_dir_inside_output_dir_is_refused_and_the_input_unchanged(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(TINY, out / "epoch_0")
    before = _tree(out)
    proc = tune_run(out, f"checkpointer.checkpoint_dir={out / 'epoch_0'}", "epochs=1",
                    "max_steps_per_epoch=3", check=False)
    assert proc.returncode != 0
    assert f"output_dir {out} contains checkpointer.checkpoint_dir ({out / 'epoch_0'})" in proc.stderr
    assert _tree(out) == before  # not a byte written, no logs/, no config copy


@pytest.mark.slow
def test_output_dir_equal_to_checkpoint_dir_leaves_the_input_byte_identical(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    before = _tree(model)
    with pytest.raises(ConfigKeyError, match=f"output_dir {model} is checkpointer.checkpoint_dir"):
        _setup(_cfg(model, **{"checkpointer.checkpoint_dir": str(model)}))
    assert _tree(model) == before


# ---- 2. a run owns its output_dir -----------------------------------------------------------------
@pytest.mark.slow
def test_a_second_run_is_refused_and_the_first_finishes_with_its_checkpoints_intact(tmp_path):
    out = tmp_path / "out"
    cmd = [TUNE, "run", "squash_finetune", "--config", str(TINY_CONFIG), f"output_dir={out}", *QUICK,
           "epochs=1", "max_steps_per_epoch=3", "save_every_n_steps=1", "keep_last_n=5"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / ".squash-run.lock").exists() or not (out / "logs").exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.05)
        planted = out / ".squash-tmp-step_99.x"  # as if the first run were saving now
        planted.mkdir()
        with pytest.raises(RuntimeError, match=rf"output_dir {out} is in use by another run \(pid {first.pid} on host "):
            _setup(_cfg(out, epochs=1, max_steps_per_epoch=3))
        assert planted.is_dir()  # the refused start-up cleaned nothing
        planted.rmdir()
        assert first.wait(timeout=600) == 0, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    names = sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", "epoch_")))
    assert names == ["epoch_0", "step_1", "step_2", "step_3"]
    for name in names:
        manifest.verify(out / name)
    assert not (out / ".squash-run.lock").exists()


def test_a_fresh_run_into_a_used_output_dir_is_refused_and_its_checkpoints_untouched(trained, tmp_path):
    """The probe's case: a finished run's directory (epoch_0, epoch_1, step_9, step_10) and a
    new fresh run with step checkpoints and keep_last_n: refused in one line before anything is
    written or pruned; a resume of the finished run is still allowed."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    for step in (9, 10):
        shutil.copytree(trained / "epoch_1", out / f"step_{step}")
    before = _tree(out)
    want = (f"output_dir {out} already holds another run's checkpoints (epoch_0, epoch_1, step_9, "
            "step_10); a fresh run would mix with them. Continue that run with "
            "resume_from_checkpoint=True, or give another output_dir")  # fmt: skip
    with pytest.raises(ConfigKeyError) as info:
        _setup(_cfg(out, epochs=2, max_steps_per_epoch=3, save_every_n_steps=1, keep_last_n=1))
    assert str(info.value) == want
    assert _tree(out) == before
    proc = tune_run(out, "epochs=2", "max_steps_per_epoch=3", "save_every_n_steps=1",
                    "keep_last_n=1", check=False)  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"squash_finetune: config error: {want}"
    )
    assert _tree(out) == before  # no logs/, no config copy, no lock file, nothing pruned


def test_an_empty_or_checkpoint_free_output_dir_is_fine_for_a_fresh_run(tmp_path):
    from squash.runs import run_lock

    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "epoch_notes").mkdir()  # not a checkpoint name
    assert run_lock.checkpoints_in(out) == []
    run_lock.refuse_used_output_dir(_cfg(out))
    (out / "step_3").mkdir()  # an incomplete checkpoint is another run's too
    with pytest.raises(ConfigKeyError, match=r"holds another run's checkpoints \(step_3\)"):
        run_lock.refuse_used_output_dir(_cfg(out))
    run_lock.refuse_used_output_dir(_cfg(out, resume_from_checkpoint=True))


# ---- 3. checkpoints are what was written ----------------------------------------------------------
def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_each_file_is_refused_on_resume_and_in_squash_eval(trained, tmp_path):
    files = sorted(manifest.read_verified_meta(trained / "epoch_1")["files"]) + ["checkpoint.json"]
    assert {"squash_adapter.safetensors", "recipe_state.pt", "model.safetensors",
            "adapter/adapter_model.safetensors"} <= set(files)
    for rel in files:
        out = tmp_path / rel.replace("/", "_")
        shutil.copytree(trained / "epoch_1", out / "epoch_1")
        _flip(out / "epoch_1" / rel)
        where = str(out / "epoch_1" / rel)
        with pytest.raises(CheckpointIntegrityError, match=where):
            _setup(_cfg(out, resume_from_checkpoint=True, **KEYS))
        with pytest.raises(CheckpointIntegrityError, match=f"adapter_dir: .*{where}"):
            _setup(_cfg(tmp_path / "eval", EVAL_CONFIG, adapter_dir=str(out / "epoch_1")),
                   squash_eval.SquashEvalRecipe)
    # the merged weights, evaluated through the checkpointer
    with pytest.raises(CheckpointIntegrityError, match="checkpointer.checkpoint_dir: .*model.safetensors"):
        _setup(_cfg(tmp_path / "eval", EVAL_CONFIG, **{
            "checkpointer.checkpoint_dir": str(tmp_path / "model.safetensors" / "epoch_1"),
            "model.quantize_base": False}), squash_eval.SquashEvalRecipe)


def test_edited_counters_are_refused(trained, tmp_path):
    out = tmp_path / "state"
    shutil.copytree(trained / "epoch_0", out / "epoch_0")
    state = torch.load(out / "epoch_0" / "recipe_state.pt", weights_only=True)
    assert state["global_step"] == 1
    torch.save({**state, "global_step": 5}, out / "epoch_0" / "recipe_state.pt")
    with pytest.raises(CheckpointIntegrityError, match="epoch_0/recipe_state.pt does not match"):
        _setup(_cfg(out, resume_from_checkpoint=True, **KEYS))

    out = tmp_path / "meta"
    shutil.copytree(trained / "epoch_0", out / "epoch_0")
    meta = json.loads((out / "epoch_0" / "checkpoint.json").read_text())
    meta["global_step"] = meta["counters"]["global_step"] = 12
    (out / "epoch_0" / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointIntegrityError, match="epoch_0/checkpoint.json was changed"):
        _setup(_cfg(out, resume_from_checkpoint=True, **KEYS))


def test_recipe_state_counters_that_disagree_with_checkpoint_json_are_refused(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained / "epoch_0", out / "epoch_0")
    state = torch.load(out / "epoch_0" / "recipe_state.pt", weights_only=True)
    torch.save({**state, "global_step": 5}, out / "epoch_0" / "recipe_state.pt")
    rehash_checkpoint(out / "epoch_0")
    with pytest.raises(CheckpointIntegrityError, match="recipe_state.pt has global_step=5 but .* records 1"):
        _setup(_cfg(out, resume_from_checkpoint=True, **KEYS))


def test_an_optimizer_moment_of_the_wrong_shape_is_named(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained / "epoch_0", out / "epoch_0")
    state = torch.load(out / "epoch_0" / "recipe_state.pt", weights_only=True)
    moments = state["optimizer"]["state"]
    first = min(moments)
    moments[first]["exp_avg"] = moments[first]["exp_avg"].flatten()[:3].clone()
    torch.save(state, out / "epoch_0" / "recipe_state.pt")
    rehash_checkpoint(out / "epoch_0")
    with pytest.raises(ValueError, match=r"recipe_state.pt: the optimizer's 'exp_avg' of .* has shape \(3,\)"):
        _setup(_cfg(out, resume_from_checkpoint=True, **KEYS))


# ---- 4. a resume continues the run it resumes -----------------------------------------------------
@pytest.mark.slow
def test_a_resume_with_a_changed_batch_size_is_refused_and_the_override_accepted(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained / "epoch_0", out / "epoch_0")
    with pytest.raises(ValueError, match=r"batch_size: 4 in the checkpoint, 2 now.*"
                                         r"resume_allow_config_change=True"):
        _setup(_cfg(out, resume_from_checkpoint=True, **KEYS, batch_size=2))
    # free keys change without a word: output_dir, logging, checkpoint cadence
    _setup(_cfg(out, resume_from_checkpoint=True, **KEYS, save_every_n_steps=5, log_every_n_steps=2))
    cfg = _cfg(out, resume_from_checkpoint=True, **KEYS, batch_size=2, resume_allow_config_change=True)
    recipe = squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)
    try:
        recipe.setup(cfg)
        assert recipe._dataloader.batch_size == 2 and recipe.global_step == 1
        recipe.train()  # epoch 1 with the new batch size
    finally:
        recipe.cleanup()
    meta = manifest.verify(out / "epoch_1")
    assert meta["global_step"] == 2 and meta["config"]["batch_size"] == 2


def test_a_resume_after_the_data_or_the_base_weights_changed_in_place_is_refused(tmp_path):
    """The probe's case: the data file's content, then one tensor of the base weights, edited at
    the same path between a run and its resume: refused naming the file; the override key
    resumes anyway; restored files resume as before."""
    base, data = tmp_path / "base", tmp_path / "data.json"
    shutil.copytree(TINY, base)
    shutil.copy(TINY / "alpaca_tiny.json", data)
    inputs = {"checkpointer.checkpoint_dir": str(base), "dataset.data_files": str(data)}
    out = tmp_path / "out"
    cfg = _cfg(out, **KEYS, **inputs)
    recipe = finetune_in_process(cfg)
    shutil.rmtree(out / "epoch_1")  # as if killed after epoch_0
    recorded = manifest.verify(out / "epoch_0")["inputs"]["dataset.data_files"]
    assert recorded["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    resume = _cfg(out, resume_from_checkpoint=True, **KEYS, **inputs)

    records = json.loads(data.read_text())
    original = data.read_bytes()
    records[0]["output"] = records[0]["output"] + " (edited)"
    data.write_text(json.dumps(records))
    with pytest.raises(ValueError) as info:
        _setup(resume)
    assert str(info.value) == (
        f"resume_from_checkpoint: {data} (dataset.data_files) changed since the run that wrote "
        f"{out / 'epoch_0'} read it; the resume would not continue that run. Restore the file, "
        "or set resume_allow_config_change=True to continue with it"
    )
    data.write_bytes(original)

    from safetensors.torch import load_file, save_file

    weights = base / "model.safetensors"
    saved = weights.read_bytes()
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0  # one value of one tensor
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^resume_from_checkpoint: {weights} "
                                         r"\(checkpointer.checkpoint_dir\) changed since"):
        _setup(resume)
    allowed = _cfg(out, resume_from_checkpoint=True, resume_allow_config_change=True, **KEYS, **inputs)
    assert _setup(allowed).global_step == 1
    weights.write_bytes(saved)
    assert _setup(resume).global_step == 1


# ---- 5. bad values are named ----------------------------------------------------------------------
def _empty_file(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("")
    return str(path)


def _null_output(tmp_path):
    records = json.loads((TINY / "alpaca_tiny.json").read_text())[:8]
    records[0]["output"] = None
    path = tmp_path / "null.json"
    path.write_text(json.dumps(records))
    return str(path)


@pytest.mark.parametrize("key, value, message", [
    ("optimizer.lr", "abc", r"optimizer.lr must be a number"),
    ("seed", "abc", r"seed must be an integer >= 0, got 'abc'"),
    ("clip_grad_norm", "abc", r"clip_grad_norm must be a number > 0 or null, got 'abc'"),
    ("tokenizer.max_seq_len", 0, r"tokenizer.max_seq_len must be an integer >= 1, got 0"),
    ("dataset.data_files", _empty_file, r"dataset.data_files: .*empty.json is empty \(0 bytes\)"),
    ("dataset.data_files", _null_output, r"dataset \(.*null.json\): record 0 cannot be used: it has null \['output'\]"),
])
def test_each_bad_value_names_its_key_or_file(tmp_path, key, value, message):
    if callable(value):
        value = value(tmp_path)
    with pytest.raises((ConfigKeyError, ValueError), match=message):
        _setup(_cfg(tmp_path / "out", **{key: value}))


def test_a_gpu_device_without_a_gpu_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigKeyError, match="device: cuda, but this machine has no usable GPU"):
        _setup(_cfg(tmp_path / "out", device="cuda"))


def test_an_output_dir_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=f"output_dir {tmp_path / 'file' / 'out'} cannot be created"):
        _setup(_cfg(tmp_path / "file" / "out"))


def test_saving_an_empty_model_state_dict_is_named(tmp_path):
    from squash.models.opt import OPTCheckpointer

    writer = OPTCheckpointer(str(TINY), ["model.safetensors"], str(tmp_path))
    with pytest.raises(ValueError, match=r"'model' entry \(0 keys\) has no 'tok_embeddings.weight'"):
        writer.save_checkpoint({"model": {}}, epoch=0)
    assert list(tmp_path.iterdir()) == []
