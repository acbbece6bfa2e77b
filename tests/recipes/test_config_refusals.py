"""Every bad config value is one line naming its key (or file), and a run that stops on it
leaves its output directory as it was: no directory made, no log, no torchtune_config.yaml, a
refused resume not overwriting the run's copy. Each case is a real attempt through the recipe
class in-process; one goes through the real ``tune run``."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import REPO, TINY_CONFIG, tune_run
from tests.helpers import declare_dtype
from tests.helpers import tree as _tree

sys.path.insert(0, str(REPO / "recipes"))
import squash_finetune  # noqa: E402

from squash.config.keys import ConfigKeyError  # noqa: E402
from squash.config.values import check_values  # noqa: E402
from squash.runs import manifest  # noqa: E402
from squash.runs.manifest import CheckpointIntegrityError  # noqa: E402

TINY = REPO / "assets" / "tiny_opt"
KEYS = dict(epochs=2, max_steps_per_epoch=1)
Recipe = squash_finetune.SquashFinetuneRecipeSingleDevice


def _cfg(out, **changes):
    cfg = OmegaConf.load(TINY_CONFIG)
    cfg.output_dir = str(out)
    cfg.device, cfg.dtype = "cpu", "fp32"  # as tests.helpers.QUICK: the CPU in fp32 on any host
    cfg.batch_size = 4
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _attempt(cfg, patch=None):
    """Build the recipe, set it up (and train, with ``patch`` applied to it), clean up."""
    recipe = Recipe(cfg)
    try:
        recipe.setup(cfg)
        if patch is not None:
            patch(recipe)
            recipe.train()
    finally:
        recipe.cleanup()
    return recipe


def _refused(cfg, error, message, out, patch=None):
    """The attempt raises ``error`` with exactly ``message`` (one line) and leaves ``out`` as it
    was (byte for byte; absent if it was absent)."""
    before = _tree(out)
    with pytest.raises(error) as info:
        _attempt(cfg, patch)
    assert str(info.value) == message
    assert "\n" not in message
    assert _tree(out) == before


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run (one step an epoch): epoch_0 and epoch_1 and its config copy."""
    out = tmp_path_factory.mktemp("trained") / "out"
    _attempt(_cfg(out, **KEYS), patch=lambda recipe: None)
    assert (out / "torchtune_config.yaml").is_file() and (out / "epoch_1").is_dir()
    return out


# ---- values: type and range, named, before anything is written ------------------------------------
# (tests/test_validate.py runs this list through `squash validate` too)
BAD_VALUES = [
    ("save_adapter_weights_only", "nope", "save_adapter_weights_only must be true or false, got 'nope'"),
    ("shuffle", "maybe", "shuffle must be true or false, got 'maybe'"),
    ("enable_activation_checkpointing", "nope",
     "enable_activation_checkpointing must be true or false, got 'nope'"),
    ("resume_from_checkpoint", "nope", "resume_from_checkpoint must be true or false, got 'nope'"),
    ("compile", "nope", "compile must be true or false, got 'nope'"),
    ("log_peak_memory_stats", 1, "log_peak_memory_stats must be true or false, got 1"),
    ("lr_scheduler.num_warmup_steps", -3, "lr_scheduler.num_warmup_steps must be an integer >= 0, got -3"),
    ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
    ("epochs", -1, "epochs must be an integer >= 1, got -1"),
    ("max_steps_per_epoch", 2.5, "max_steps_per_epoch must be an integer >= 1, got 2.5"),
    ("gradient_accumulation_steps", "two", "gradient_accumulation_steps must be an integer >= 1, got 'two'"),
    ("save_every_n_steps", 0, "save_every_n_steps must be an integer >= 1, got 0"),
    ("keep_last_n", -2, "keep_last_n must be an integer >= 1, got -2"),
    ("optimizer.lr", math.inf, "optimizer.lr must be a number, finite and > 0, got inf"),
    ("optimizer.lr", math.nan, "optimizer.lr must be a number, finite and > 0, got nan"),
    ("optimizer.lr", -0.01, "optimizer.lr must be a number, finite and > 0, got -0.01"),
    ("optimizer.lr", 0, "optimizer.lr must be a number, finite and > 0, got 0"),
    ("model.sparsity", 1.5, "model.sparsity must be a number in [0, 1), got 1.5"),
    ("model.sparsity", 1.0, "model.sparsity must be a number in [0, 1), got 1.0"),
    ("model.lora_rank", 0, "model.lora_rank must be an integer >= 1, got 0"),
    ("model.lora_rank", 8.5, "model.lora_rank must be an integer >= 1, got 8.5"),
    ("model.lora_dropout", 1.0, "model.lora_dropout must be a number in [0, 1), got 1.0"),
    ("model.lora_dropout", -0.1, "model.lora_dropout must be a number in [0, 1), got -0.1"),
    ("model.sparse_factor", "c", "model.sparse_factor must be one of a, b, both, got 'c'"),
    ("model.lora_alpha", math.nan, "model.lora_alpha must be a finite number, got nan"),
    ("model.quantize_base", "yes", "model.quantize_base must be true or false, got 'yes'"),
    ("model.apply_lora_to_mlp", "no", "model.apply_lora_to_mlp must be true or false, got 'no'"),
    ("dataset.packed", "no", "dataset.packed must be true or false, got 'no'"),
]  # fmt: skip


@pytest.mark.parametrize("key, value, message", BAD_VALUES)
def test_each_bad_value_is_one_line_naming_its_key_and_nothing_is_written(tmp_path, key, value, message):
    out = tmp_path / "new" / "out"
    _refused(_cfg(out, **{key: value}), ConfigKeyError, message, tmp_path / "new")


def test_a_bad_value_into_a_finished_run_leaves_it_byte_identical(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    _refused(_cfg(out, resume_from_checkpoint=True, shuffle="maybe", **KEYS), ConfigKeyError,
             "shuffle must be true or false, got 'maybe'", out)


def test_a_max_seq_len_the_prompt_fills_is_named_and_nothing_is_left(tmp_path):
    out = tmp_path / "new" / "out"
    message = (f"tokenizer.max_seq_len=1 leaves no token to train on in the first 8 records of "
               f"dataset ({TINY / 'alpaca_tiny.json'}): the prompt template alone fills it; raise "
               "tokenizer.max_seq_len")  # fmt: skip
    cfg = _cfg(out, **{"tokenizer.max_seq_len": 1})
    cfg.tokenizer.merges_path = str(TINY / "merges.txt")  # resolved paths, as in the message
    cfg.tokenizer.vocab_path = str(TINY / "vocab.json")
    cfg.dataset.data_files = str(TINY / "alpaca_tiny.json")
    _refused(cfg, ConfigKeyError, message, tmp_path / "new")


# ---- files: named ---------------------------------------------------------------------------------
def test_a_data_file_that_is_not_json_is_named(tmp_path):
    bad = tmp_path / "data.json"
    bad.write_text('[{"instruction": "a", "input": "", "output": "b"},')
    error = "line 1: Expecting value: line 1 column 51 (char 50)"
    _refused(_cfg(tmp_path / "out", **{"dataset.data_files": str(bad)}), ConfigKeyError,
             f"dataset.data_files: {bad} is neither JSON nor JSON Lines ({error})", tmp_path / "out")
    lines = tmp_path / "lines.json"  # JSON Lines are data too
    lines.write_text("\n".join(json.dumps(r) for r in json.loads((TINY / "alpaca_tiny.json").read_text())))
    check_values(_cfg(tmp_path / "out", **{"dataset.data_files": str(lines)}))


def test_an_empty_merges_txt_and_a_tokenizer_json_that_is_not_json_are_named(tmp_path):
    empty = tmp_path / "merges.txt"
    empty.write_text("#version: 0.2\n")
    _refused(_cfg(tmp_path / "out", **{"tokenizer.merges_path": str(empty)}), ConfigKeyError,
             f"tokenizer.merges_path: {empty} holds no merges (a BPE merges.txt lists one merge a "
             "line); give the tokenizer's real merges.txt", tmp_path / "out")
    from squash.models.opt import opt_tokenizer

    with pytest.raises(ValueError, match=f"^{empty} holds no merges"):
        opt_tokenizer(str(TINY / "vocab.json"), str(empty))

    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"<s>": 0, ')
    _refused(_cfg(tmp_path / "out", **{"tokenizer.vocab_path": str(vocab)}), ConfigKeyError,
             f"tokenizer.vocab_path: {vocab} is not JSON (Expecting property name enclosed in "
             "double quotes: line 1 column 12 (char 11))", tmp_path / "out")
    # SmolLM2's block names a directory: its tokenizer.json is read as JSON
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "tokenizer.json").write_text('{"model": {"vocab": ')
    cfg = OmegaConf.create({"tokenizer": {"_component_": "squash.models.smollm2.smollm2_tokenizer",
                                          "path": str(model)}})
    with pytest.raises(ConfigKeyError) as info:
        check_values(cfg)
    assert str(info.value) == (f"tokenizer.path: {model / 'tokenizer.json'} is not JSON (Expecting "
                               "value: line 1 column 21 (char 20))")
    (model / "tokenizer_config.json").write_text("{}")
    from squash.models.smollm2 import smollm2_tokenizer

    with pytest.raises(ValueError, match=f"^Cannot read {model / 'tokenizer.json'} .* as a tokenizer"):
        smollm2_tokenizer(str(model))


def test_a_safetensors_dtype_other_than_the_config_s_is_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    first = declare_dtype(model / "model.safetensors", "F16", "BF16")
    message = (f"checkpointer.checkpoint_files: {model / 'model.safetensors'} declares {first} as "
               f"BF16, but {model / 'config.json'} says float16: the weights would be read as the "
               "wrong type; fix the file or its config.json")  # fmt: skip
    _refused(_cfg(tmp_path / "out", **{"checkpointer.checkpoint_dir": str(model)}), ConfigKeyError,
             message, tmp_path / "out")
    from squash.models.opt import OPTCheckpointer

    reader = OPTCheckpointer(str(model), ["model.safetensors"], str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=f"^{model / 'model.safetensors'} declares {first} as BF16"):
        reader.load_checkpoint()
    # the same model with a config.json that says what the file holds is read
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert reader.load_checkpoint()["model"]


def _tiny_llama_fp16(directory):
    """A tiny Llama saved in float16 by transformers (its config.json says float16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).half().save_pretrained(str(directory), safe_serialization=True)
    return directory


@pytest.mark.parametrize("files", [
    ["model.safetensors"],
    {"filename_format": "model-{}-of-{}.safetensors", "max_filename": "00001"},  # not a list
])  # fmt: skip
def test_torchtune_s_hf_checkpointer_is_checked_where_squash_loads_the_base(tmp_path, files):
    """torchtune's FullModelHFCheckpointer reads a header as it declares it; squash checks the
    files that checkpointer resolved before it loads them (every recipe, every checkpointer)."""
    from squash.assembly.model_setup import load_base

    model = _tiny_llama_fp16(tmp_path / "llama")
    weights = model / "model.safetensors"
    if isinstance(files, dict):  # the same file under the name the format gives
        weights = weights.rename(model / "model-00001-of-00001.safetensors")
    first = declare_dtype(weights, "F16", "BF16")
    cfg = OmegaConf.create({"checkpointer": {
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": str(model), "checkpoint_files": files, "model_type": "LLAMA3",
        "output_dir": str(tmp_path / "out"),
    }})  # fmt: skip
    from torchtune import config as tt_config

    if isinstance(files, list):  # refused from the config already, before anything is made
        with pytest.raises(ConfigKeyError, match="declares"):
            check_values(cfg)
    else:  # a filename_format mapping: the config-time check cannot see the files
        check_values(cfg)
    # what torchtune alone does: the BF16 header is believed, the F16 data read as BF16
    loaded = tt_config.instantiate(cfg.checkpointer).load_checkpoint()["model"]
    assert {v.dtype for v in loaded.values()} == {torch.bfloat16}
    with pytest.raises(ConfigKeyError) as info:
        load_base(cfg.checkpointer)
    assert str(info.value) == (
        f"checkpointer.checkpoint_files: {weights} declares {first} as BF16, "
        f"but {model / 'config.json'} says float16: the weights would be read as the wrong type; "
        "fix the file or its config.json"
    )


def test_checkpointer_output_dir_equal_to_the_model_dir_is_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    message = (f"checkpointer.output_dir {model} is checkpointer.checkpoint_dir ({model}), which "
               "this run reads; writing logs, the config copy, checkpoints or exports there could "
               "change its input. Give an checkpointer.output_dir outside every directory the run "
               "reads")  # fmt: skip
    _refused(_cfg(tmp_path / "out", **{"checkpointer.checkpoint_dir": str(model),
                                       "checkpointer.output_dir": str(model)}),
             ConfigKeyError, message, tmp_path)


# ---- checkpoints and resumes ----------------------------------------------------------------------
def test_a_refused_resume_is_one_line_and_keeps_the_run_s_config_copy(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    message = (f"resume_from_checkpoint: the config differs from the run that wrote {out / 'epoch_1'} "
               "in keys that change the results: batch_size: 4 in the checkpoint, 2 now. Resume "
               "with the checkpoint's values, or set resume_allow_config_change=True to continue "
               "with the new ones")  # fmt: skip
    cfg = _cfg(out, resume_from_checkpoint=True, **KEYS)
    cfg.batch_size = 2
    _refused(cfg, ConfigKeyError, message, out)


@pytest.mark.parametrize("edit, message", [
    (lambda meta: meta.update(format=99),
     "{file} is of checkpoint format 99; this squash reads format 2 only (a checkpoint from "
     "another squash version?)"),
    (lambda meta: meta.update(extra={"run": "me"}),
     "{file} has field(s) ['extra'] that checkpoint format 2 does not define; it was not written "
     "by this squash"),
])  # fmt: skip
def test_a_checkpoint_json_of_another_format_or_with_an_unknown_field_is_refused(trained, tmp_path, edit, message):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    file = out / "epoch_1" / "checkpoint.json"
    meta = json.loads(file.read_text())
    assert "inputs" in meta and set(meta) == manifest.FIELDS  # every field written is known
    edit(meta)
    meta["sha256"] = manifest._self_hash(meta)  # consistent with itself: refused for what it says
    file.write_text(json.dumps(meta))
    _refused(_cfg(out, resume_from_checkpoint=True, **KEYS), CheckpointIntegrityError,
             message.format(file=file), out)


def test_a_nan_stop_after_a_resume_names_the_checkpoint_resumed_from(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "epoch_1")  # resume from epoch_0 and train step 2

    def nan_loss(recipe):
        recipe._loss_step = lambda batch: torch.tensor(float("nan"))

    with pytest.raises(RuntimeError) as info:
        _attempt(_cfg(out, resume_from_checkpoint=True, **KEYS), patch=nan_loss)
    assert str(info.value) == (
        "The loss became nan at step 2 (epoch 2); stopping before the optimizer step. Last good "
        f"checkpoint: {out / 'epoch_0'}"
    )


@pytest.mark.slow
def test_tune_run_prints_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "new" / "out"
    proc = tune_run(out, "save_adapter_weights_only=nope", "optimizer.lr=.inf", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "squash_finetune: config error: save_adapter_weights_only must be true or false, got 'nope'"
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_tune_run_refuses_a_resume_and_a_damaged_checkpoint_in_one_line(trained, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    before = _tree(out)
    proc = tune_run(out, "resume_from_checkpoint=True", "epochs=2", "max_steps_per_epoch=1",
                    "batch_size=2", check=False)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"squash_finetune: config error: resume_from_checkpoint: the config differs from the run "
        f"that wrote {out / 'epoch_1'} in keys that change the results: batch_size: 4"
    )
    assert _tree(out) == before  # its torchtune_config.yaml included
    file = out / "epoch_1" / "checkpoint.json"
    meta = json.loads(file.read_text())
    meta["format"] = 99
    meta["sha256"] = manifest._self_hash(meta)
    file.write_text(json.dumps(meta))
    before = _tree(out)
    proc = tune_run(out, "resume_from_checkpoint=True", "epochs=2", "max_steps_per_epoch=1",
                    check=False)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"squash_finetune: checkpoint error: {file} is of checkpoint format 99; this squash reads "
        "format 2 only (a checkpoint from another squash version?)"
    )
    assert _tree(out) == before


@pytest.mark.parametrize("override, message", [
    ("shuffle=maybe", "shuffle must be true or false, got 'maybe'"),
    ("model.sparse_factor=c", "model.sparse_factor must be one of a, b, both, got 'c'"),
    ("optimizer.lr=-1", "optimizer.lr must be a number, finite and > 0, got -1"),
])
def test_squash_validate_refuses_the_same_values(capsys, override, message):
    from squash.cli import main

    assert main(["validate", str(TINY_CONFIG), override]) == 1
    assert capsys.readouterr().err.strip() == f"squash validate: {TINY_CONFIG}: config error: {message}"
