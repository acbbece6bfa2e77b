"""``squash.merge``: an adapter-only checkpoint, merged in memory into the base its run recorded,
equals the merged weights the recipe itself writes (a real ``tune run`` of the tiny OPT: NF4
base, FFI adapters); the base is checked against the sha256 the run recorded, wherever it is;
nothing but a model builder is instantiated from a checkpoint; nothing is written where the
export reads."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from squash.chat import load_checkpoint
from squash.cli import main as cli_main
from squash.export.gguf import load_merged_checkpoint
from squash.merge import export_checkpoint, load_checkpoint_model
from squash.runs import checkpoint as ckpt
from squash.runs.manifest import CheckpointIntegrityError

from tests.helpers import REPO, rehash_checkpoint, tune_run

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny OPT run (merged weights saved too) from a copy of the tiny OPT with a chat
    template; returns (base, epoch_0, an adapter-only twin of epoch_0)."""
    root = tmp_path_factory.mktemp("merge")
    base = root / "base"
    shutil.copytree(REPO / "assets" / "tiny_opt", base)
    (base / "chat_template.jinja").write_text(TEMPLATE)
    tune_run(root / "run", f"checkpointer.checkpoint_dir={base}", "epochs=1",
             "max_steps_per_epoch=2")  # fmt: skip
    epoch = root / "run" / "epoch_0"
    # what save_adapter_weights_only: True writes: the same directory without the merged weights
    twin = root / "twin" / "epoch_0"
    shutil.copytree(epoch, twin, ignore=shutil.ignore_patterns("model*.safetensors"))
    rehash_checkpoint(twin)
    return base, epoch, twin


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_run_records_its_base_files(run):
    base, epoch, _ = run
    record = json.loads((epoch / "checkpoint.json").read_text())["base"]
    assert record["path"] == str(base.resolve()) and record["key"] == "checkpointer.checkpoint_dir"
    assert record["files"] == {
        f.name: {"sha256": _sha256(f), "size": f.stat().st_size} for f in base.iterdir()
    }


def test_adapter_only_checkpoint_merges_to_the_recipes_merged_weights(run):
    _, epoch, twin = run
    config, want = load_merged_checkpoint(epoch)  # the recipe's merge, OPT checkpointer's keys
    got = load_checkpoint_model(twin)
    # the base's config.json; the recipe's checkpointer records the dtype it wrote instead
    drop = lambda c: {k: v for k, v in c.items() if k not in ("dtype", "torch_dtype")}  # noqa: E731
    assert drop(got.config) == drop(config) and sorted(got.weights) == sorted(want)
    adapted = [k for k in want if "q_proj.weight" in k]
    for key in want:
        assert torch.equal(got.weights[key], want[key]), key
    # the merge changed what it should: the adapted weights differ from the NF4 base alone
    base_config, base = load_merged_checkpoint(run[0])
    assert all(not torch.equal(want[k], base[k]) for k in adapted)


@pytest.mark.slow
def test_an_init_svd_adapter_merges_into_the_residual_base_as_the_recipe_does(tmp_path):
    """With ``init: svd`` the trained base is the NF4 of ``W - B0 A0``; the merge recomputes it
    from the base, as a resume does, and lands on the recipe's merged weights to float32
    rounding (the SVD computed again in another process: measured 1.5e-8 apart at weights of
    0.1, two ulps)."""
    tune_run(tmp_path / "run", "epochs=1", "max_steps_per_epoch=2", "model.init=svd")
    epoch = tmp_path / "run" / "epoch_0"
    twin = tmp_path / "twin" / "epoch_0"
    shutil.copytree(epoch, twin, ignore=shutil.ignore_patterns("model*.safetensors"))
    rehash_checkpoint(twin)
    _, want = load_merged_checkpoint(epoch)
    got = load_checkpoint_model(twin).weights
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-7, rtol=0, msg=key)


def test_chat_on_the_adapter_only_checkpoint_answers_as_the_merged_weights(run, capsys):
    from transformers import AutoModelForCausalLM

    _, epoch, twin = run
    chat = load_checkpoint(twin)
    prompt = chat.prompt_ids([{"role": "user", "content": "Give three tips"}])
    ref = AutoModelForCausalLM.from_pretrained(str(epoch), dtype=torch.float32).eval()
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                        eos_token_id=chat.eos_ids, pad_token_id=0)  # fmt: skip
    want = want[0, len(prompt):].tolist()
    want = [t for t in want if t not in chat.eos_ids]
    assert list(chat.generate(prompt, 6)) == want
    assert cli_main(["chat", "--checkpoint", str(twin), "--prompt", "Give three tips",
                     "--max-new-tokens", "6"]) == 0  # fmt: skip
    assert capsys.readouterr().out == chat.tokenizer.decode(want, skip_special_tokens=True) + "\n"


def test_a_changed_base_is_refused_naming_the_file(run, tmp_path):
    base, _, twin = run
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    assert load_checkpoint_model(twin, moved).weights.keys()  # a moved, unchanged copy is fine
    (moved / "extra.txt").write_text("x")
    with pytest.raises(CheckpointIntegrityError, match="extra.txt is not in the base recorded"):
        load_checkpoint_model(twin, moved)
    (moved / "extra.txt").unlink()
    weights = bytearray((moved / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (moved / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(CheckpointIntegrityError, match="safetensors is not the file the base"):
        load_checkpoint_model(twin, moved)
    (moved / "model.safetensors").unlink()
    with pytest.raises(CheckpointIntegrityError, match="model.safetensors is missing"):
        load_checkpoint_model(twin, moved)
    args = ["chat", "--checkpoint", str(twin), "--base", str(moved), "--prompt", "hi"]
    assert cli_main(args) == 1


def test_a_checkpoint_without_a_base_record_needs_base_and_is_merged_unchecked(
    run, tmp_path, caplog
):
    base, epoch, twin = run
    old = tmp_path / "old" / "epoch_0"
    shutil.copytree(twin, old)
    meta = json.loads((old / "checkpoint.json").read_text())
    del meta["base"]  # as squash wrote it before it recorded the base
    (old / "checkpoint.json").write_text(json.dumps(meta))
    rehash_checkpoint(old)
    with pytest.raises(ValueError, match=f"records no hashes of the base.*read {base}.*--base DIR"):
        load_checkpoint_model(old)
    got = load_checkpoint_model(old, base)
    assert "used unchecked" in caplog.text
    _, want = load_merged_checkpoint(epoch)
    assert all(torch.equal(got.weights[k], want[k]) for k in want)


def _with_model_block(twin: Path, dest: Path, model) -> Path:
    """A copy of ``twin`` whose squash_adapter_config.json holds ``model``, rehashed (so the
    integrity check passes: the hash is unkeyed, anyone can rewrite it)."""
    bad = dest / "epoch_0"
    shutil.copytree(twin, bad)
    cfg_path = bad / ckpt.SQUASH_ADAPTER_CONFIG_FILE
    cfg = json.loads(cfg_path.read_text())
    cfg["model"] = model
    cfg_path.write_text(json.dumps(cfg))
    rehash_checkpoint(bad)
    return bad


def test_the_exploit_of_a_subprocess_run_model_block_runs_nothing(run, tmp_path, monkeypatch, capsys):
    """The probe's exploit: ``"model": {"_component_": "subprocess.run", "args": ["touch",
    "PWNED"]}`` given to ``squash chat`` and ``squash export`` creates nothing and is one line."""
    base, _, twin = run
    exploit = {"_component_": "subprocess.run", "args": ["touch", "PWNED"]}
    bad = _with_model_block(twin, tmp_path / "bad", exploit)
    monkeypatch.chdir(tmp_path)
    cfg_path = bad / ckpt.SQUASH_ADAPTER_CONFIG_FILE
    want = (f"{cfg_path}: model._component_ 'subprocess.run' is not one of squash's model "
            "builders")  # fmt: skip
    assert cli_main(["chat", "--checkpoint", str(bad), "--base", str(base), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"squash chat: {want}") and err.count("\n") == 1, err
    out = tmp_path / "gguf"
    assert cli_main(["export", str(bad), "--output-dir", str(out), "--base", str(base)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"squash export: {want}") and err.count("\n") == 1, err
    assert not (tmp_path / "PWNED").exists() and not out.exists()


@pytest.mark.parametrize(
    "model, key, what",
    [
        ({"_component_": "os.system", "command": "touch ran"}, "_component_", "'os.system'"),
        ({"_component_": "squash.models.squash_model", "builder": "x"}, "_component_", "squash_model"),
        ({"_component_": "torchtune.models.llama3_2.lora_llama3_2_1b"}, "_component_", "torchtune"),
        # a _component_ nested inside an argument of an allowed builder
        ({"_component_": "squash.models.opt.squash_opt_tiny", "lora_attn_modules": ["q_proj"],
          "lora_rank": {"_component_": "subprocess.run", "args": ["touch", "ran"]}},
         "lora_rank", "a _component_ 'subprocess.run'"),
        ({"_component_": "squash.models.opt.squash_opt_tiny",
          "lora_attn_modules": [{"_component_": "subprocess.run", "args": ["touch", "ran"]}]},
         "lora_attn_modules", "a _component_ 'subprocess.run'"),
        ({"_component_": "squash.models.opt.squash_opt_tiny", "lora_attn_modules": ["q_proj"],
          "sparse_factor": "${oc.env:HOME}"}, "sparse_factor", "the interpolation"),
        ({"_component_": "squash.models.opt.squash_opt_tiny", "lora_attn_modules": ["q_proj"],
          "not_an_argument": 1}, "not_an_argument", "is not an argument of"),
    ],
)  # fmt: skip
def test_a_model_block_naming_other_code_is_refused(run, tmp_path, monkeypatch, model, key, what):
    _, _, twin = run
    bad = _with_model_block(twin, tmp_path / "bad", model)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        load_checkpoint_model(bad)
    message = str(info.value)
    assert message.startswith(f"{bad / ckpt.SQUASH_ADAPTER_CONFIG_FILE}: model.{key} ")
    assert what in message and "\n" not in message
    assert not (tmp_path / "ran").exists()


def test_the_allow_list_names_squash_builders_only():
    from squash.models import adapter_builders
    from squash.models.opt import squash_opt_tiny

    builders = adapter_builders()
    assert builders["squash.models.opt.squash_opt_tiny"] is squash_opt_tiny
    assert "squash.models.smollm2.squash_smollm2_135m" in builders
    assert "squash.models.opt.qlora_opt_tiny" in builders and "squash.models.opt.lora_opt" in builders
    assert all(k.startswith("squash.models.") for k in builders)
    assert not {"squash.models.squash_model", "squash.models.opt.opt_tiny"} & set(builders)


def _edited_model_block(twin: Path, dest: Path, key: str, value) -> Path:
    """A copy of ``twin`` whose model block has ``key`` set to ``value``, rehashed."""
    model = json.loads((twin / ckpt.SQUASH_ADAPTER_CONFIG_FILE).read_text())["model"]
    return _with_model_block(twin, dest, {**model, key: value})


@pytest.mark.parametrize("key, value, what", [
    ("lora_rank", -1, "must be an integer >= 1, got -1"),
    ("lora_rank", 2.5, "must be an integer >= 1, got 2.5"),
    ("sparsity", 1.5, "must be a number in [0, 1), got 1.5"),
    ("lora_dropout", 1.0, "must be a number in [0, 1), got 1.0"),
    ("sparse_factor", "c", "must be one of a, b, both, got 'c'"),
    ("lora_alpha", "x", "must be a finite number, got 'x'"),
    ("init", "bogus", "must be one of lora, svd, loftq, got 'bogus'"),
    ("quantize_base", "yes", "must be true or false, got 'yes'"),
])  # fmt: skip
def test_chat_and_export_check_the_model_block_s_values_before_building(
    run, tmp_path, monkeypatch, capsys, key, value, what
):
    """The recipes' own range and type checks, on a checkpoint whose hashes are consistent (an
    edit anyone can make): one line naming the file and the key, before the base is read."""
    base, _, twin = run
    bad = _edited_model_block(twin, tmp_path / "bad", key, value)
    want = f"{bad / ckpt.SQUASH_ADAPTER_CONFIG_FILE}: model.{key} {what}"

    def unreached(*args, **kwargs):
        raise AssertionError("the base was read before the model block was checked")

    monkeypatch.setattr("squash.merge.base_state_dict", unreached)
    assert cli_main(["chat", "--checkpoint", str(bad), "--prompt", "hi"]) == 1
    assert capsys.readouterr().err == f"squash chat: {want}\n"
    out = tmp_path / "gguf"
    assert cli_main(["export", str(bad), "--output-dir", str(out), "--base", str(base)]) == 1
    assert capsys.readouterr().err == f"squash export: {want}\n"
    assert not out.exists()


def test_a_model_block_value_the_builder_refuses_names_the_file(run, tmp_path, capsys):
    _, _, twin = run
    bad = _edited_model_block(twin, tmp_path / "bad", "lora_attn_modules", ["nope"])
    out = tmp_path / "gguf"
    assert cli_main(["export", str(bad), "--output-dir", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"squash export: {bad / ckpt.SQUASH_ADAPTER_CONFIG_FILE}: model "
        "(squash.models.opt.squash_opt_tiny): lora_attn_modules must be a non-empty subset of "
        "['q_proj', 'k_proj', 'v_proj', 'output_proj'], got ['nope']\n"
    )
    assert not out.exists()


def test_a_seed_of_the_wrong_type_in_checkpoint_json_is_refused(run, tmp_path):
    _, _, twin = run
    bad = tmp_path / "epoch_0"
    shutil.copytree(twin, bad)
    meta = json.loads((bad / "checkpoint.json").read_text())
    meta["counters"]["seed"] = "x"
    (bad / "checkpoint.json").write_text(json.dumps(meta))
    rehash_checkpoint(bad)
    with pytest.raises(ValueError) as info:
        load_checkpoint_model(bad)
    assert str(info.value) == (
        f"{bad / 'checkpoint.json'}: counters.seed must be an integer >= 0, got 'x'"
    )


@pytest.mark.slow
def test_squash_export_refuses_an_edited_sparsity_in_one_line(run, tmp_path):
    import subprocess
    import sys

    _, _, twin = run
    bad = _edited_model_block(twin, tmp_path / "bad", "sparsity", 1.5)
    out = tmp_path / "gguf"
    squash = str(Path(sys.executable).with_name("squash"))
    proc = subprocess.run([squash, "export", str(bad), "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"squash export: {bad / ckpt.SQUASH_ADAPTER_CONFIG_FILE}: model.sparsity must be a "
        "number in [0, 1), got 1.5"
    )
    assert not out.exists()


def test_export_writes_nowhere_it_reads(run, tmp_path):
    base, _, twin = run
    for inside in (twin, twin / "gguf", base / "gguf"):
        with pytest.raises(ValueError, match="inside"):
            export_checkpoint(twin, {"gguf": ["f16"]}, inside)
        assert not inside.exists() or inside == twin
    assert sorted(p.name for p in base.iterdir()) == sorted(
        json.loads((twin / "checkpoint.json").read_text())["base"]["files"]
    )


def _flip_exponent_bit(path: Path) -> None:
    """Flip the top exponent bit of the first float32 weight in a safetensors file, by hand."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    first = min(
        (v["data_offsets"][0] for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    )
    data[8 + n + first + 3] ^= 0x40  # little-endian float32: byte 3 holds the sign and exponent
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["merged", "adapter"])
def test_export_and_chat_refuse_a_flipped_bit_as_resume_does(run, tmp_path, capsys, which):
    base, epoch, twin = run
    source = epoch if which == "merged" else twin
    damaged = tmp_path / "run" / "epoch_0"
    shutil.copytree(source, damaged)
    name = "model.safetensors" if which == "merged" else ckpt.SQUASH_ADAPTER_FILE
    _flip_exponent_bit(damaged / name)
    want = f"{damaged / name} does not match {damaged / 'checkpoint.json'} (sha256 "
    out = tmp_path / "gguf"
    assert cli_main(["export", str(damaged), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"squash export: {want}") and err.endswith("the file is damaged\n"), err
    assert err.count("\n") == 1 and not out.exists()
    assert cli_main(["chat", "--checkpoint", str(damaged), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"squash chat: {want}") and err.count("\n") == 1, err
    # resume's own verification says the same of the same directory
    from squash.runs import manifest

    with pytest.raises(CheckpointIntegrityError, match="does not match"):
        manifest.verify(damaged)


def test_a_squash_checkpoint_without_its_checkpoint_json_is_refused(run, tmp_path, capsys):
    _, epoch, _ = run
    stripped = tmp_path / "epoch_0"
    shutil.copytree(epoch, stripped)
    (stripped / "checkpoint.json").unlink()  # it would otherwise pass for a plain HF directory
    with pytest.raises(CheckpointIntegrityError, match="checkpoint.json is missing"):
        load_checkpoint_model(stripped)


def test_export_into_the_checkpoint_is_refused_by_the_command(run, capsys):
    _, epoch, _ = run
    before = sorted(p.name for p in epoch.rglob("*"))
    for out in (epoch, epoch / "gguf"):
        assert cli_main(["export", str(epoch), "--output-dir", str(out)]) == 1
        err = capsys.readouterr().err
        assert err == (f"squash export: --output-dir {out} is inside {epoch}, which the export "
                       "reads; give a directory outside the checkpoint and the base model\n")  # fmt: skip
    assert sorted(p.name for p in epoch.rglob("*")) == before
