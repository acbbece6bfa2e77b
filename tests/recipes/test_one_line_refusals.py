"""Every refusal the docs promise as one line is one line: each case goes through the recipe's
real entry point (``recipe_main``, torchtune's ``@config.parse`` reading the command line), or
the ``squash`` command, in-process, and ends in exit status 1 with no traceback and a last line
naming the key or the file. ``SQUASH_FULL_ERROR=1`` gives the traceback back. (The config file
refusals, a YAML error, a top-level list and a directory, are in tests/config/
test_refused_configs.py and, through the real ``tune run``, tests/test_validate.py.)"""

import errno
import json
import shutil
import socket
import sys

import pytest

from tests.helpers import QUICK, REPO, TINY_CONFIG, tree

sys.path.insert(0, str(REPO / "recipes"))
import squash_finetune  # noqa: E402

from squash.cli import main as cli_main  # noqa: E402
from squash.config.keys import ConfigKeyError  # noqa: E402
from squash.runs.run_lock import RunLock  # noqa: E402

TINY = REPO / "assets" / "tiny_opt"
STEP = ["epochs=1", "max_steps_per_epoch=1"]


def _main(monkeypatch, capsys, out, *overrides):
    """``tune run squash_finetune --config configs/opt_tiny.yaml output_dir=OUT ...`` in-process:
    the last line it printed on stderr (it must exit with status 1, without a traceback)."""
    argv = ["squash_finetune", "--config", str(TINY_CONFIG), f"output_dir={out}", *QUICK, *overrides]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as info:
        squash_finetune.recipe_main()
    err = capsys.readouterr().err
    assert info.value.code == 1, err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()][-1]


def test_an_output_dir_in_use_is_one_line_naming_the_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    holder = RunLock(out)  # another run's lock (this process on another file description)
    try:
        before = tree(out)
        line = _main(monkeypatch, capsys, out, *STEP)
        assert line.startswith(
            f"squash_finetune: config error: output_dir {out} is in use by another run (pid "
            f"{holder.record['pid']} on host {socket.gethostname()}, started "
        ), line
        assert line.endswith("wait for it to finish or give another output_dir")
        assert tree(out) == before
    finally:
        holder.release()


def test_init_svd_with_a_rank_above_the_bound_names_lora_rank(tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "out"
    line = _main(monkeypatch, capsys, out, *STEP, "model.init=svd", "model.lora_rank=129")
    # the tiny OPT's attention weights are 128 x 128: 128 singular vectors
    assert line == (
        "squash_finetune: config error: model.lora_rank=129 is above what model.init: svd can give "
        "layers.0.attn.q_proj (a (128, 128) weight has 128 singular vectors); set "
        "model.lora_rank <= 128 or model.init: lora"
    )
    assert not (tmp_path / "new").exists()
    monkeypatch.setenv("SQUASH_FULL_ERROR", "1")  # the traceback, when asked for
    monkeypatch.setattr(sys, "argv", sys.argv)
    with pytest.raises(ConfigKeyError, match=r"^model.lora_rank=129 is above"):
        squash_finetune.recipe_main()


def test_heldout_on_data_that_trains_on_its_input_is_named(tmp_path, monkeypatch, capsys):
    """alpaca with ``train_on_input: True`` labels every token: no prompt to answer from."""
    out = tmp_path / "new" / "out"
    heldout = ["heldout.dataset._component_=torchtune.datasets.alpaca_dataset",
               "heldout.dataset.source=json", f"heldout.dataset.data_files={TINY / 'alpaca_tiny.json'}",
               "heldout.dataset.split=train[:4]", "heldout.dataset.train_on_input=True"]  # fmt: skip
    line = _main(monkeypatch, capsys, out, *STEP, *heldout)
    assert line == (
        "squash_finetune: config error: heldout.dataset: sample 0 has no prompt to generate the "
        "held-out answer from (every token is a label); set heldout.dataset.train_on_input: False"
    )
    assert not (tmp_path / "new").exists()


def _full_disk_on_the_peft_adapter(monkeypatch, error):
    """The OPT checkpointer's safetensors writer fails with ``error`` on the PEFT adapter."""
    from squash.models.opt import _checkpointer

    real = _checkpointer.save_file

    def save_file(tensors, path, *args, **kwargs):
        if str(path).endswith("adapter_model.safetensors"):
            raise error
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(_checkpointer, "save_file", save_file)


def _safetensor_error():
    from safetensors import SafetensorError

    return SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                           'message: "No space left on device" })')  # fmt: skip


@pytest.mark.parametrize("error, text", [
    (OSError(errno.ENOSPC, "No space left on device"), "[Errno 28] No space left on device"),
    (_safetensor_error(), 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })'),
])  # fmt: skip
def test_a_full_disk_while_writing_the_peft_adapter_names_the_checkpoint_and_the_space(
    tmp_path, monkeypatch, capsys, error, text
):
    out = tmp_path / "out"
    _full_disk_on_the_peft_adapter(monkeypatch, error)
    line = _main(monkeypatch, capsys, out, *STEP)
    prefix = f"squash_finetune: checkpoint error: Cannot write checkpoint epoch_0 into output_dir {out} ("
    assert line.startswith(prefix), line
    free, rest = line[len(prefix):].split(")", 1)
    assert free.endswith(" MiB free there") and float(free.split()[0]) > 0
    assert rest == f": {text}. The checkpoints already there are unchanged"
    assert not [p for p in out.iterdir() if p.name.startswith(("epoch_", ".squash-tmp"))]


def test_chat_without_a_chat_template_names_the_directory(tmp_path, capsys):
    assert cli_main(["chat", "--checkpoint", str(TINY), "--prompt", "hi"]) == 1
    assert capsys.readouterr().err == (
        f"squash chat: {TINY} has no chat template (chat_template.jinja, or chat_template in "
        "tokenizer_config.json), which chat needs to turn messages into a prompt; add the base "
        "model's template there\n"
    )
    # with a template, a bad generation option is one line too
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert json.loads((model / "config.json").read_text())["architectures"] == ["OPTForCausalLM"]
    assert cli_main(["chat", "--checkpoint", str(model), "--prompt", "hi", "--max-new-tokens", "0"]) == 1
    err = capsys.readouterr().err  # after transformers' own "Loading weights" progress bar
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "squash chat: max_new_tokens must be at least 1, got 0"
