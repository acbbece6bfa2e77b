"""``checkpoint.json``: what a checkpoint directory holds, so that a changed byte is refused.

The writer (:func:`squash.runs.checkpoint.write_checkpoint`) calls :func:`write_meta` last,
once every other file is in the temporary directory. ``checkpoint.json`` then records:

- ``epoch``, ``global_step``: as before (what ``latest_checkpoint`` orders by);
- ``counters``: the plain counters of ``recipe_state.pt`` (``epochs_run``, ``global_step``,
  ``steps_in_epoch``, ``seed``, ``total_epochs``, ``max_steps_per_epoch``, ``world_size``);
- ``files``: ``{relative path: {"sha256", "size"}}`` of every other file of the directory;
- ``config``: the resolved config of the run that wrote it (from its lock, see
  :mod:`squash.runs.run_lock`; None when written outside a run);
- ``base``: the base model the run read (``checkpointer.checkpoint_dir``) as
  :func:`directory_record` recorded it when the run started: its path and the sha256 and size
  of each of its files, so an export or chat that merges the adapter into that base can check
  it is the same (:func:`verify_directory`); None when written outside a run, and absent from
  checkpoints written before runs recorded it;
- ``inputs``: ``{key: {"path", "sha256", "size"}}`` of the data and tokenizer files the run
  read (:func:`squash.runs.run_lock.input_record`), so a resume notices one edited in place;
  None outside a run, absent from older checkpoints;
- ``format``: :data:`FORMAT` (2); a reader refuses any other version, and any field not
  listed here (:data:`FIELDS`);
- ``sha256``: of the canonical JSON of all of the above, so an edit of ``checkpoint.json`` itself
  is caught too.

:func:`verify` checks all of it and :func:`check_counters` that ``recipe_state.pt`` agrees;
resume and ``squash_eval`` call them before they load anything from the directory.
"""

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from squash._io import file_sha256

META_FILE = "checkpoint.json"  # = squash.runs.checkpoint.CHECKPOINT_META_FILE
RECIPE_STATE = "recipe_state.pt"
FORMAT = 2
# Every field of a format-2 checkpoint.json (see the module docstring); any other is refused.
FIELDS = frozenset({"epoch", "global_step", "format", "counters", "files", "config", "base",
                    "inputs", "sha256"})  # fmt: skip
COUNTERS = ("epochs_run", "global_step", "steps_in_epoch", "seed", "total_epochs",
            "max_steps_per_epoch", "world_size")  # fmt: skip


class CheckpointIntegrityError(ValueError):
    """A checkpoint directory whose files do not match its ``checkpoint.json``; names the file."""


def file_table(path: Path) -> Dict[str, Dict[str, Any]]:
    """``{relative path: {"sha256", "size"}}`` of every file under ``path`` but checkpoint.json."""
    path = Path(path)
    table = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path).as_posix()
        if f.is_file() and rel != META_FILE:
            table[rel] = {"sha256": file_sha256(f), "size": f.stat().st_size}
    return table


def _self_hash(meta: Dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_meta(
    path: Path,
    meta: Dict[str, Any],
    recipe_state: Dict[str, Any],
    lock: Optional[Dict[str, Any]],
) -> Dict[str, Any]:
    """Write ``path/checkpoint.json``: ``meta`` plus counters, file hashes, the run's config and
    the hash of it all (see the module docstring). Call it after every other file is written.

    Args:
        path (Path): the (temporary) checkpoint directory.
        meta (Dict[str, Any]): ``epoch`` and ``global_step``.
        recipe_state (Dict[str, Any]): what ``recipe_state.pt`` holds; its counters are copied.
        lock (Optional[Dict[str, Any]]): the record of the run's lock
            (:func:`squash.runs.run_lock.read_lock` of its output directory), which names the
            run's config, base and inputs; copied only if this process holds the lock.

    Returns:
        Dict[str, Any]: what was written.
    """
    lock = lock or {}
    full = {
        **meta,
        "format": FORMAT,
        "counters": {k: recipe_state[k] for k in COUNTERS if k in recipe_state},
        "files": file_table(path),
        "config": lock.get("config") if lock.get("pid") == os.getpid() else None,
        "base": lock.get("base") if lock.get("pid") == os.getpid() else None,
        "inputs": lock.get("inputs") if lock.get("pid") == os.getpid() else None,
    }
    full["sha256"] = _self_hash(full)
    (Path(path) / META_FILE).write_text(json.dumps(full, indent=2, sort_keys=True))
    return full


def directory_record(path: Path) -> Dict[str, Any]:
    """What a run records of a directory it reads (the base model): ``{"path": resolved path,
    "files": {name: {"sha256", "size"}}}`` of every regular file directly in ``path``."""
    path = Path(path).resolve()
    files = {
        f.name: {"sha256": file_sha256(f), "size": f.stat().st_size}
        for f in sorted(path.iterdir())
        if f.is_file()
    }
    return {"path": str(path), "files": files}


def verify_directory(record: Dict[str, Any], path: Path, what: str) -> Path:
    """Check that the directory ``path`` holds exactly the files ``record``
    (:func:`directory_record`) lists, with their sizes and sha256.

    Args:
        record (Dict[str, Any]): what was recorded.
        path (Path): the directory to check (the recorded one, or one the user names).
        what (str): how errors name the record, e.g. ``"the base recorded in .../checkpoint.json"``.

    Returns:
        Path: ``path``.

    Raises:
        CheckpointIntegrityError: naming the first file that is missing, not recorded, or of
            another size or sha256, or a directory that does not exist.
    """
    path = Path(path)
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict):
        raise CheckpointIntegrityError(f"{what} lists no files; it cannot be checked")
    if not path.is_dir():
        raise CheckpointIntegrityError(f"{path}, {what}, does not exist")
    on_disk = {f.name for f in path.iterdir() if f.is_file()}
    for name in sorted(set(files) - on_disk):
        raise CheckpointIntegrityError(f"{path / name} is missing; {what} has it")
    for name in sorted(on_disk - set(files)):
        raise CheckpointIntegrityError(f"{path / name} is not in {what}: the directory changed")
    for name, want in sorted(files.items()):
        f = path / name
        if f.stat().st_size != want.get("size") or file_sha256(f) != want.get("sha256"):
            raise CheckpointIntegrityError(
                f"{f} is not the file {what} has (another size or sha256): the base model "
                "changed since the run read it"
            )
    return path


def read_verified_meta(path: Path) -> Dict[str, Any]:
    """``checkpoint.json`` of ``path``, checked against its own hash (files not yet checked).

    Raises:
        CheckpointIntegrityError: naming ``checkpoint.json`` if it is missing, unreadable, from
            an older squash without file hashes, of another format version than :data:`FORMAT`,
            has a field format 2 does not define, or changed since it was written.
    """
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointIntegrityError(
            f"{file} is missing: {path} is not a complete squash checkpoint"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointIntegrityError(f"{file} cannot be read ({e}); the checkpoint is damaged") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointIntegrityError(
            f"{file} records no file hashes (written by squash before checkpoint format "
            f"{FORMAT}?); it cannot be verified"
        )
    version = meta.get("format")
    if isinstance(version, bool) or version != FORMAT:
        raise CheckpointIntegrityError(
            f"{file} is of checkpoint format {version!r}; this squash reads format {FORMAT} "
            "only (a checkpoint from another squash version?)"
        )
    unknown = sorted(set(meta) - FIELDS)
    if unknown:
        raise CheckpointIntegrityError(
            f"{file} has field(s) {unknown} that checkpoint format {FORMAT} does not define; "
            "it was not written by this squash"
        )
    if meta.get("sha256") != _self_hash(meta):
        raise CheckpointIntegrityError(
            f"{file} was changed after it was written (its recorded sha256 does not match its "
            "content); the checkpoint is damaged"
        )
    return meta


def verify(path: Path) -> Dict[str, Any]:
    """Check every file of the checkpoint directory ``path`` against ``checkpoint.json``.

    Returns:
        Dict[str, Any]: the verified ``checkpoint.json``.

    Raises:
        CheckpointIntegrityError: naming the first file that is missing, not recorded, or of
            another size or sha256 than recorded (or ``checkpoint.json`` itself).
    """
    path = Path(path)
    meta = read_verified_meta(path)
    recorded = meta["files"]
    on_disk = {
        f.relative_to(path).as_posix()
        for f in path.rglob("*")
        if f.is_file() and f.relative_to(path).as_posix() != META_FILE
    }
    for rel in sorted(set(recorded) - on_disk):
        raise CheckpointIntegrityError(f"{path / rel} is recorded in {path / META_FILE} but missing")
    for rel in sorted(on_disk - set(recorded)):
        raise CheckpointIntegrityError(f"{path / rel} is not recorded in {path / META_FILE}")
    for rel in sorted(recorded):
        want, f = recorded[rel], path / rel
        size = f.stat().st_size
        if size != want.get("size"):
            raise CheckpointIntegrityError(
                f"{f} has {size} bytes, {path / META_FILE} records {want.get('size')}; the file "
                "is damaged"
            )
        digest = file_sha256(f)
        if digest != want.get("sha256"):
            raise CheckpointIntegrityError(
                f"{f} does not match {path / META_FILE} (sha256 {digest[:12]}..., recorded "
                f"{str(want.get('sha256'))[:12]}...); the file is damaged"
            )
    return meta


def check_counters(path: Path, meta: Dict[str, Any], recipe_state: Dict[str, Any]) -> None:
    """Check that ``recipe_state.pt``'s counters equal those ``checkpoint.json`` records.

    Raises:
        CheckpointIntegrityError: naming the counter and both files.
    """
    path = Path(path)
    want = dict(meta.get("counters", {}))
    want.setdefault("global_step", meta.get("global_step"))
    for key, value in want.items():
        if recipe_state.get(key) != value:
            raise CheckpointIntegrityError(
                f"{path / RECIPE_STATE} has {key}={recipe_state.get(key)!r} but "
                f"{path / META_FILE} records {value!r}; the checkpoint is inconsistent"
            )


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only or vanished directory); the
    message names the checkpoint, the directory and the space left there."""


def names_write_errors(write: Callable) -> Callable:
    """Decorate a checkpoint writer ``write(output_dir, name, ...)`` so that a failed write (a
    full disk, a read-only or vanished directory) raises a :class:`CheckpointWriteError` naming
    the checkpoint, the directory and the space left, instead of the writer's own message
    (torch.save's ``[enforce fail at inline_container.cc] unexpected pos``, safetensors'
    ``SafetensorError: Error while serializing: IoError(... No space left on device ...)``)."""

    @functools.wraps(write)
    def wrapper(output_dir, name, *args, **kwargs):
        try:
            return write(output_dir, name, *args, **kwargs)
        except CheckpointWriteError:
            raise
        except Exception as e:
            if not isinstance(e, OSError) and not _is_io_error(e):
                raise
            try:
                free = f"{shutil.disk_usage(output_dir).free / 2**20:.1f} MiB free there"
            except OSError:
                free = "its free space unknown"
            raise CheckpointWriteError(
                f"Cannot write checkpoint {name} into output_dir {output_dir} ({free}): "
                f"{' '.join(str(e).split())}. The checkpoints already there are unchanged"
            ) from e

    return wrapper


def _is_io_error(e: Exception) -> bool:
    """A writer's error that is an I/O failure: torch.save's (a ``RuntimeError``) or safetensors'
    (a ``SafetensorError``), told by their text."""
    if not isinstance(e, RuntimeError) and type(e).__name__ != "SafetensorError":
        return False
    text = str(e)
    return any(s in text for s in ("inline_container", "unexpected pos", "PytorchStreamWriter",
                                   "file write failed", "No space left", "Errno", "IoError",
                                   "os error"))  # fmt: skip


def verify_inputs(cfg: Any) -> None:
    """Verify the squash checkpoints a config reads: ``adapter_dir`` (which must be one), and any
    ``checkpointer.checkpoint_dir`` or ``teacher_checkpointer.checkpoint_dir`` that holds a
    ``checkpoint.json`` (the merged weights of a squash checkpoint; a plain HF model has none).

    Raises:
        CheckpointIntegrityError: naming the key and the file that does not match.
    """
    keys = ["adapter_dir", "checkpointer.checkpoint_dir", "teacher_checkpointer.checkpoint_dir"]
    for key in keys:
        node = cfg
        for part in key.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        if not isinstance(node, str):
            continue
        path = Path(node)
        if key != "adapter_dir" and not (path / META_FILE).is_file():
            continue
        try:
            verify(path)
        except CheckpointIntegrityError as e:
            raise CheckpointIntegrityError(f"{key}: {e}") from e
