"""The run's tokenizer rebuilt from an adapter-only checkpoint's ``checkpoint.json`` for the
sensitivity calibration (:mod:`squash.checkpoint_tokenizer`): only squash's own builders, only
verified files; everything else is one line naming ``checkpoint.json`` and the key."""

import shutil

import pytest

from squash.checkpoint_tokenizer import checkpoint_tokenizer
from squash.models.opt import opt_tokenizer
from squash.runs import manifest
from tests.helpers import REPO

TINY = REPO / "assets" / "tiny_opt"
TEXT = "def f(x):\n    return x ** 2  # squash"


def _record(path):
    path = path.resolve()
    return {"path": str(path), "sha256": manifest.file_sha256(path), "size": path.stat().st_size}


def _meta(base, tokenizer, inputs=None):
    """What a run on the base copy ``base`` records: its hashes, config and input files."""
    files = {k: str(base / f"{k.split('_')[0]}.{'json' if k == 'vocab_path' else 'txt'}")
             for k in ("vocab_path", "merges_path")}  # fmt: skip
    block = {"_component_": "squash.models.opt.opt_tokenizer", **files, "max_seq_len": 128,
             **tokenizer}  # fmt: skip
    if inputs is None:
        inputs = {f"tokenizer.{k}": _record(base / v.split("/")[-1]) for k, v in files.items()}
    return {"config": {"tokenizer": block}, "base": manifest.directory_record(base),
            "inputs": inputs}


@pytest.fixture
def base(tmp_path):
    shutil.copytree(TINY, tmp_path / "base")
    return tmp_path / "base"


def _ids(tok):
    return tok.encode(TEXT, add_bos=False, add_eos=False)


def test_the_runs_tokenizer_is_rebuilt_from_the_verified_base(base, tmp_path):
    want = _ids(opt_tokenizer(str(TINY / "vocab.json"), str(TINY / "merges.txt")))
    meta = _meta(base, {})
    moved = tmp_path / "moved"  # squash export --base MOVED: the base's verified copy serves
    shutil.move(base, moved)
    tok = checkpoint_tokenizer(tmp_path / "ckpt", meta, moved)
    assert _ids(tok) == want


def test_a_file_outside_the_base_serves_when_it_is_the_one_recorded(base, tmp_path):
    outside = tmp_path / "tok"
    outside.mkdir()
    merges = outside / "merges.txt"
    lines = (TINY / "merges.txt").read_text().splitlines(keepends=True)
    merges.write_text("".join(lines[:-1]))  # one merge fewer: not the base's merges.txt
    meta = _meta(base, {"merges_path": str(merges)})
    meta["inputs"]["tokenizer.merges_path"] = _record(merges)
    checkpoint_tokenizer(tmp_path / "ckpt", meta, base)  # verified at its recorded path
    merges.write_text("".join(lines[:-2]))  # changed since the run read it
    with pytest.raises(ValueError) as e:
        checkpoint_tokenizer(tmp_path / "ckpt", meta, base)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'ckpt' / 'checkpoint.json'}: tokenizer.merges_path: no "
                          "file with the sha256 the run recorded")  # fmt: skip
    assert "save_adapter_weights_only: false" in msg and "\n" not in msg


@pytest.mark.parametrize("component", ["os.system", "torchtune.models.llama3.llama3_tokenizer",
                                       None, "squash.models.opt.OPTTokenizer"])
def test_a_tokenizer_builder_not_on_the_allow_list_is_refused(base, tmp_path, component):
    meta = _meta(base, {"_component_": component, "command": f"touch {tmp_path / 'ran'}"})
    with pytest.raises(ValueError) as e:
        checkpoint_tokenizer(tmp_path / "ckpt", meta, base)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'ckpt' / 'checkpoint.json'}: tokenizer._component_ "
                          f"{component!r} is not one of squash's tokenizer builders")  # fmt: skip
    assert "\n" not in msg and not (tmp_path / "ran").exists()


def test_a_key_that_is_not_the_builders_argument_is_refused(base, tmp_path):
    meta = _meta(base, {"special_tokens_path": "/etc/passwd"})
    with pytest.raises(ValueError, match=r"checkpoint.json: tokenizer.special_tokens_path is not "
                                         r"an argument of squash.models.opt.opt_tokenizer$"):
        checkpoint_tokenizer(tmp_path / "ckpt", meta, base)


def test_no_recorded_tokenizer_or_file_is_refused_with_what_to_do(base, tmp_path):
    with pytest.raises(ValueError, match="records no tokenizer block .*save merged weights"):
        checkpoint_tokenizer(tmp_path / "ckpt", {"config": None}, base)
    meta = _meta(base, {}, inputs={})  # files the run did not record, no directory of the base
    with pytest.raises(ValueError, match=r"tokenizer.vocab_path .* is not a file the run "
                                         r"recorded nor its verified base directory"):
        checkpoint_tokenizer(tmp_path / "ckpt", meta, base)


def _smollm2_meta(base, path, inputs):
    block = {"_component_": "squash.models.smollm2.smollm2_tokenizer", "path": str(path),
             "max_seq_len": 96}  # fmt: skip
    return {"config": {"tokenizer": block}, "base": manifest.directory_record(base),
            "inputs": inputs}


@pytest.mark.smollm2
def test_smollm2s_tokenizer_comes_from_the_verified_base_only(smollm2_checkpoint, tmp_path):
    from squash.models.smollm2 import smollm2_tokenizer

    base = tmp_path / "base"
    base.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_checkpoint / name, base / name)
    want = _ids(smollm2_tokenizer(str(smollm2_checkpoint)))
    ckpt = tmp_path / "ckpt"
    by_dir = _smollm2_meta(base, base, {})  # the run named the directory (no file recorded)
    by_file = _smollm2_meta(base, base / "tokenizer.json",
                            {"tokenizer.path": _record(base / "tokenizer.json")})  # fmt: skip
    moved = tmp_path / "moved"
    shutil.move(base, moved)
    assert _ids(checkpoint_tokenizer(ckpt, by_dir, moved)) == want
    assert _ids(checkpoint_tokenizer(ckpt, by_file, moved)) == want
    other = tmp_path / "other"  # a directory that is not the base
    shutil.copytree(moved, other)
    with pytest.raises(ValueError, match=r"tokenizer.path .*other is not a file the run recorded"):
        checkpoint_tokenizer(ckpt, _smollm2_meta(moved, other, {}), moved)
    # a tokenizer.json outside the base: its tokenizer_config.json beside it is not verified
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    outside = {"tokenizer.path": _record(other / "tokenizer.json")}
    with pytest.raises(ValueError, match=r"tokenizer.path: no file with the sha256 the run "
                                         r"recorded for .* in the verified base [^ ]*; "):
        checkpoint_tokenizer(ckpt, _smollm2_meta(moved, other / "tokenizer.json", outside), moved)
