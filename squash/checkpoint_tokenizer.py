"""The tokenizer an adapter-only checkpoint's run used, rebuilt for the calibration of a
``model.base_outliers`` base with ``criterion: sensitivity`` (what ``squash export`` and ``squash
chat`` need to rebuild the outliers ``S`` that run trained on).

``checkpoint.json`` records the run's config, but a checkpoint is data, never code: its
``tokenizer`` block is read only if its ``_component_`` is one of squash's own tokenizer builders
(:data:`TOKENIZER_BUILDERS`, an allow-list), every other key is an argument of that builder, and
each file the builder reads is a verified one:

- a file of the base directory, already checked against the hashes the run recorded, whose
  sha256 is that of the file the run read (``checkpoint.json``'s ``inputs``) or, when the run
  recorded none (a directory argument), the base directory itself named by the recorded path;
- else the file at the path the run read, if its size and sha256 are those it recorded (OPT's
  ``vocab_path`` and ``merges_path``; SmolLM2's tokenizer reads a second file beside the one
  named, so only the verified base directory serves it).

Only the file arguments are passed: ``encode``, all the calibration calls, uses neither
``max_seq_len`` nor ``prompt_template``. Torchtune's own tokenizers (the Llama 3.2 and Qwen 2.5
families) are not squash's and are refused; such a run exports through its merged weights.
"""

import inspect
from pathlib import Path
from typing import Any, Dict, Optional

from squash.runs import manifest

__all__ = ["TOKENIZER_BUILDERS", "checkpoint_tokenizer"]

# builder -> its file arguments, and whether a file outside the base may serve them
TOKENIZER_BUILDERS = {
    "squash.models.opt.opt_tokenizer": (("vocab_path", "merges_path"), True),
    "squash.models.smollm2.smollm2_tokenizer": (("path",), False),
}
_ADVICE = ("to export or chat with a model.base_outliers criterion: sensitivity adapter, save "
           "merged weights (save_adapter_weights_only: false)")  # fmt: skip


def _builder(component: str) -> Any:
    if component == "squash.models.opt.opt_tokenizer":
        from squash.models.opt import opt_tokenizer

        return opt_tokenizer
    from squash.models.smollm2 import smollm2_tokenizer

    return smollm2_tokenizer


def checkpoint_tokenizer(checkpoint_dir: Path, meta: Dict[str, Any], base_dir: Path) -> Any:
    """The run's tokenizer of the adapter-only checkpoint ``checkpoint_dir``, built from its
    ``checkpoint.json`` (``meta``, already verified) and the verified base ``base_dir``.

    Raises:
        ValueError: one line naming ``checkpoint.json`` and the key at fault (a tokenizer not on
            the allow-list, a key that is not the builder's argument, a file that cannot be
            verified), and what to do instead. Nothing is built or read before the checks.
    """
    where = Path(checkpoint_dir) / manifest.META_FILE
    block = _mapping(meta.get("config")).get("tokenizer")
    if not isinstance(block, dict):
        raise ValueError(f"{where}: records no tokenizer block (written outside a run?), and "
                         f"the calibration needs the run's tokenizer; {_ADVICE}")  # fmt: skip
    component = block.get("_component_")
    if not isinstance(component, str) or component not in TOKENIZER_BUILDERS:
        raise ValueError(
            f"{where}: tokenizer._component_ {component!r} is not one of squash's tokenizer "
            f"builders ({', '.join(TOKENIZER_BUILDERS)}); a checkpoint names no other code, and "
            f"the calibration needs the run's tokenizer; {_ADVICE}"
        )
    builder = _builder(component)
    file_keys, outside = TOKENIZER_BUILDERS[component]
    params = inspect.signature(builder).parameters
    for key in block:
        if key != "_component_" and key not in params:
            raise ValueError(f"{where}: tokenizer.{key} is not an argument of {component}")
    args = {}
    for key in file_keys:
        value = block.get(key)
        if not isinstance(value, str):
            raise ValueError(f"{where}: tokenizer.{key} must be a path, got {value!r}")
        args[key] = str(_verified_file(key, value, meta, Path(base_dir), outside, where))
    return builder(**args)


def _verified_file(
    key: str, value: str, meta: Dict[str, Any], base_dir: Path, outside: bool, where: Path
) -> Path:
    """Where the verified copy of the file (or base directory) ``value`` the run read is."""
    base, inputs = _mapping(meta.get("base")), _mapping(meta.get("inputs"))
    base_files = _mapping(base.get("files"))
    recorded = inputs.get(f"tokenizer.{key}")
    if not isinstance(recorded, dict):  # a directory (not recorded as an input): the base's
        if base_files and isinstance(base.get("path"), str) and _same(value, base["path"]):
            return base_dir
        raise ValueError(f"{where}: tokenizer.{key} {value} is not a file the run recorded nor "
                         f"its verified base directory; {_ADVICE}")  # fmt: skip
    sha, size = recorded.get("sha256"), recorded.get("size")
    for name, info in sorted(base_files.items()):
        if isinstance(info, dict) and info.get("sha256") == sha and info.get("size") == size:
            if _matches(base_dir / name, sha, size):  # checked again where it is read
                return base_dir / name
    path = Path(str(recorded.get("path", "")))
    if outside and _matches(path, sha, size):
        return path
    raise ValueError(f"{where}: tokenizer.{key}: no file with the sha256 the run recorded "
                     f"for {value} in the verified base {base_dir}"
                     f"{' nor at that path' if outside else ''}; {_ADVICE}")  # fmt: skip


def _mapping(value: Any) -> Dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _same(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def _matches(path: Path, sha: Optional[str], size: Optional[int]) -> bool:
    return path.is_file() and path.stat().st_size == size and manifest.file_sha256(path) == sha
