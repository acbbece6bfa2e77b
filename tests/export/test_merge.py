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
from squash.training import checkpoint as ckpt
from squash.training.manifest import CheckpointIntegrityError

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


def test_a_model_block_naming_other_code_is_refused(run, tmp_path):
    _, _, twin = run
    bad = tmp_path / "bad" / "epoch_0"
    shutil.copytree(twin, bad)
    cfg_path = bad / ckpt.SQUASH_ADAPTER_CONFIG_FILE
    cfg = json.loads(cfg_path.read_text())
    cfg["model"] = {"_component_": "os.system", "command": f"touch {tmp_path / 'ran'}"}
    cfg_path.write_text(json.dumps(cfg))
    rehash_checkpoint(bad)
    with pytest.raises(ValueError, match="_component_ 'os.system' is not a squash or torchtune"):
        load_checkpoint_model(bad)
    assert not (tmp_path / "ran").exists()


def test_export_writes_nowhere_it_reads(run, tmp_path):
    base, _, twin = run
    for inside in (twin, twin / "gguf", base / "gguf"):
        with pytest.raises(ValueError, match="inside"):
            export_checkpoint(twin, {"gguf": ["f16"]}, inside)
        assert not inside.exists() or inside == twin
    assert sorted(p.name for p in base.iterdir()) == sorted(
        json.loads((twin / "checkpoint.json").read_text())["base"]["files"]
    )
