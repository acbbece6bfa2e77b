"""A run's output directory: never one it reads from, and owned by one live run at a time.

:func:`claim` is the first thing a recipe's ``setup`` does, before anything is written anywhere:

1. :func:`check_output_dir` refuses an ``output_dir`` that equals, contains or lies inside a
   directory the config reads (``checkpointer.checkpoint_dir``, a teacher's, ``adapter_dir``), or
   that contains a file it reads (tokenizer files, dataset files). Paths are compared resolved,
   so a symlink does not hide an overlap.
2. :class:`RunLock` takes ``output_dir/.squash-run.lock``: an advisory ``flock`` held for the
   run's lifetime on that file and on ``output_dir`` itself (so deleting the file's path does
   not let a second run in), the file naming the process (pid, host, start time, command) and
   holding the run's resolved config (each checkpoint copies it into ``checkpoint.json``, for
   the resume check of :mod:`squash.runs.resume`), the sha256 of each file of the
   base model (``checkpointer.checkpoint_dir``; copied too, for an export or chat that merges
   the adapter into that base, and for the resume check) and of each data and tokenizer file
   the run reads. The kernel drops a ``flock`` when its process dies, however it dies: a lock
   file left by a killed run is taken over with a warning naming that run; a live run's lock
   refuses the second run, naming the first. Temporary directories of an interrupted save are
   cleaned only once the lock is held, so start-up never deletes those of a live run.
   (``flock`` is local to one machine on some network file systems; two machines writing to
   one NFS ``output_dir`` are not detected there.)
3. :func:`check_owned` before every write into ``output_dir`` (checkpoints, pruning, the config
   copy, exports): the path must still be the directory the lock holds. Deleted, renamed or
   replaced by another run's directory while the run was stopped, it raises
   :class:`OutputDirLostError` and nothing is written; the lock's release then leaves the
   path, and whatever is there now, untouched.
"""

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from squash._temporaries import process_alive
from squash.config.keys import ConfigKeyError
from squash.runs import manifest

log = logging.getLogger(__name__)

LOCK_FILE = ".squash-run.lock"

# Blocks whose path-like string values the recipes read as files.
_FILE_BLOCKS = ("tokenizer",)
_DIR_KEYS = ("checkpointer.checkpoint_dir", "teacher_checkpointer.checkpoint_dir", "adapter_dir")


# ---- what a config reads --------------------------------------------------------------------------
def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, (DictConfig, dict)) or part not in node:
            return None
        node = node[part]
    return node


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple, ListConfig)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, (dict, DictConfig)):
        for v in value.values():
            yield from _strings(v)


def read_paths(cfg: DictConfig) -> List[Tuple[str, Path, bool]]:
    """What a recipe config reads from disk: ``(key, path, is_dir)`` for each checkpoint
    directory (``checkpointer.checkpoint_dir``, ``teacher_checkpointer.checkpoint_dir``,
    ``adapter_dir``), each tokenizer file (keys ending in ``path`` or ``file``), and each local
    dataset file or directory (``data_files``, ``data_dir``, a ``source`` that is a local path)."""
    found: List[Tuple[str, Path, bool]] = []
    for key in _DIR_KEYS:
        value = _get(cfg, key)
        if isinstance(value, str):
            found.append((key, Path(value), True))
    for block in _FILE_BLOCKS:
        node = _get(cfg, block)
        if isinstance(node, (DictConfig, dict)):
            for k, v in node.items():
                if isinstance(v, str) and (k.endswith("path") or k.endswith("file")):
                    found.append((f"{block}.{k}", Path(v), False))
    datasets = cfg.get("dataset")
    nodes = list(datasets) if isinstance(datasets, ListConfig) else [datasets]
    for i, node in enumerate(nodes):
        if not isinstance(node, (DictConfig, dict)):
            continue
        where = "dataset" if len(nodes) == 1 and not isinstance(datasets, ListConfig) else f"dataset[{i}]"
        for k in ("data_files", "data_dir"):
            for v in _strings(node.get(k)):
                found.append((f"{where}.{k}", Path(v), Path(v).is_dir()))
        source = node.get("source")
        if isinstance(source, str) and Path(source).exists():  # a local dataset directory or file
            found.append((f"{where}.source", Path(source), Path(source).is_dir()))
    return found


def _inside(a: Path, b: Path) -> bool:
    """``a`` equals ``b`` or lies inside it."""
    return a == b or b in a.parents


def refuse_overlap(out: Path, reads: List[Tuple[str, Path, bool]], what: str = "output_dir") -> Path:
    """Refuse an output directory ``out`` that equals, contains or lies inside a directory of
    ``reads``, or contains a file of it (``(key, path, is_dir)``, as :func:`read_paths` gives).
    Any writer can call it, e.g. an export command with ``[("CHECKPOINT_DIR", path, True)]``.

    Returns:
        Path: ``out``, resolved.

    Raises:
        ConfigKeyError: naming ``what`` and the key it overlaps.
    """
    out = Path(out).expanduser().resolve()
    for key, path, is_dir in reads:
        src = Path(path).expanduser().resolve()
        if is_dir and (_inside(out, src) or _inside(src, out)):
            how = "is" if out == src else "lies inside" if _inside(out, src) else "contains"
        elif not is_dir and _inside(src, out):
            how = "contains"
        else:
            continue
        raise ConfigKeyError(
            f"{what} {out} {how} {key} ({src}), which this run reads; writing logs, the "
            f"config copy, checkpoints or exports there could change its input. Give an "
            f"{what} outside every directory the run reads"
        )
    return out


def check_output_dir(cfg: DictConfig) -> Path:
    """:func:`refuse_overlap` of ``cfg.output_dir`` (and of ``checkpointer.output_dir``, where
    the checkpointer writes) and what ``cfg`` reads (:func:`read_paths`).

    Returns:
        Path: ``output_dir``, resolved.

    Raises:
        ConfigKeyError: naming ``output_dir`` (or ``checkpointer.output_dir``) and the key it
            overlaps.
    """
    reads = read_paths(cfg)
    out = refuse_overlap(Path(str(cfg.output_dir)), reads)
    for key in ("checkpointer.output_dir", "teacher_checkpointer.output_dir"):
        value = _get(cfg, key)
        if isinstance(value, str):
            refuse_overlap(Path(value), reads, what=key)
    return out


# ---- the lock -------------------------------------------------------------------------------------
class OutputDirLostError(RuntimeError):
    """``output_dir`` is no longer the directory this run locked (deleted, renamed, replaced);
    the message names it and what happened. Nothing was written there."""


# The locks this process holds: what :func:`check_owned` checks a path against.
_HELD: List["RunLock"] = []


def check_owned(path: Path) -> None:
    """Before a write into ``path`` (or into a directory inside it): if this process holds the
    lock of a run whose ``output_dir`` is ``path`` or contains it, that directory must still be
    the one locked (:meth:`RunLock.check_owned`). A path no lock of this process covers (a
    writer outside a run, an export's own ``--output-dir``) passes, and so does one that a
    later lock of this process holds again (two runs one after the other in one process).

    Raises:
        OutputDirLostError: naming the directory and what became of it.
    """
    target = Path(path).resolve()
    covering = [lock for lock in _HELD if lock.key == target or lock.key in target.parents]
    if covering and all(lock.lost() is not None for lock in covering):
        covering[-1].check_owned()


class OutputDirInUseError(RuntimeError):
    """Another live run holds ``output_dir``'s lock; the message names it (a recipe prints it as
    one config error: give another ``output_dir``)."""


def describe(record: Dict[str, Any]) -> str:
    """One line naming the run of a lock record."""
    started = record.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return (
        f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started {when}: "
        f"{record.get('command', '?')}"
    )


def read_lock(output_dir: Path) -> Optional[Dict[str, Any]]:
    """The record of ``output_dir``'s lock file, or None if absent or unreadable."""
    try:
        record = json.loads((Path(output_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class RunLock:
    """The advisory lock on ``output_dir`` (see the module docstring); :meth:`release` (or the
    process's exit) frees it.

    Args:
        output_dir (Path): the run's output directory (created if missing).
        run_config (Optional[Dict[str, Any]]): the run's resolved config, recorded in the lock.
        base (Optional[Dict[str, Any]]): :func:`squash.runs.manifest.directory_record` of
            the base model, recorded in the lock (each checkpoint copies it).
        inputs (Optional[Dict[str, Dict[str, Any]]]): :func:`input_record` of the files the
            run reads (data, tokenizer), recorded in the lock (each checkpoint copies it).

    Raises:
        OutputDirInUseError: another live run holds the lock; the message names it.
        OSError: ``output_dir`` cannot be created or written, naming it.
    """

    def __init__(
        self,
        output_dir: Path,
        run_config: Optional[Dict[str, Any]] = None,
        base: Optional[Dict[str, Any]] = None,
        inputs: Optional[Dict[str, Dict[str, Any]]] = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._dir_fd: Optional[int] = None
        # The directories this lock creates (outermost first): removed again at release when
        # the run left them empty, so a run that stops before writing leaves no trace.
        self._created = [p for p in (self.output_dir, *self.output_dir.parents) if not p.exists()][::-1]
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"output_dir {self.output_dir} cannot be created: {e}") from e
        # what output_dir held before the run: a directory the run made in it (a checkpointer's
        # output_dir, logs/) and left empty is removed at release too
        self._entries = set(os.listdir(self.output_dir))
        self._fd = self._acquire()
        self.record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": " ".join(sys.argv),
            "config": run_config,
            "base": base,
            "inputs": inputs,
        }
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(self.record, indent=2, sort_keys=True).encode(), 0)
        os.fsync(self._fd)
        self.key = self.output_dir.resolve()  # the path as it was when locked
        _HELD.append(self)

    def _acquire(self) -> int:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise OSError(
                    f"output_dir {self.output_dir} is not writable ({e}); give an output_dir "
                    "this user can write"
                ) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = read_lock(self.output_dir) or {}
                raise OutputDirInUseError(
                    f"output_dir {self.output_dir} is in use by another run ({describe(holder)}); "
                    "wait for it to finish or give another output_dir"
                ) from None
            # The holder may have removed the file between our open and our flock: then we
            # hold a lock on a file nobody else will see; try again on the new one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        # The directory itself is locked too: deleting the lock file's path cannot release it
        # (a second run would flock a new file, but not the directory the first still holds).
        self._dir_fd = os.open(self.output_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._dir_fd)
            self._dir_fd = None
            if os.fstat(fd).st_size == 0:  # the file this call made in place of a deleted one
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            os.close(fd)
            raise OutputDirInUseError(
                f"output_dir {self.output_dir} is in use by another run (its lock file "
                f"{LOCK_FILE} was deleted, but the run still holds the directory); wait for it "
                "to finish or give another output_dir"
            ) from None
        previous = read_lock(self.output_dir)
        if previous and previous.get("pid") is not None:
            state = "no longer running" if (
                previous.get("host") != socket.gethostname() or not process_alive(int(previous["pid"]))
            ) else "not holding the lock"
            log.warning(
                "%s: taking over the lock of an earlier run (%s), %s",
                self.output_dir, describe(previous), state,
            )
        return fd

    def lost(self) -> Optional[str]:
        """None while ``output_dir`` is the directory this lock holds; else what became of it
        (deleted, renamed, replaced), in words."""
        if self._dir_fd is None:
            return "this run released its lock"
        held = os.fstat(self._dir_fd)
        try:
            now = os.stat(self.output_dir)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return None
        where = _fd_path(self._dir_fd)
        moved = (f"it is now {where}" if where and Path(where) != self.output_dir
                 else "it was deleted")  # fmt: skip
        if now is None:
            return f"{moved} and nothing is at that path"
        holder = read_lock(self.output_dir)
        other = f" (locked by {describe(holder)})" if holder and holder.get("pid") != os.getpid() else ""
        return f"{moved} and another directory is at that path{other}"

    def check_owned(self) -> None:
        """Raise unless ``output_dir`` is still the directory this lock holds.

        Raises:
            OutputDirLostError: naming the directory and what became of it.
        """
        what = self.lost()
        if what is not None:
            raise OutputDirLostError(
                f"output_dir {self.output_dir} is no longer the directory this run locked "
                f"({what}); the run stops without writing there"
            )

    @property
    def inputs(self) -> Optional[Dict[str, Dict[str, Any]]]:
        """The input files' record this run made when it started (:func:`input_record`): what
        the data loader checks the files it reads against."""
        return self.record["inputs"]

    def release(self) -> None:
        """Remove the lock file, drop the lock and remove the directories the lock created if
        they are empty (idempotent)."""
        if self._fd is None:
            return
        if self in _HELD:
            _HELD.remove(self)
        # the path, when no longer our directory (another run's now), is left as it is; our lock
        # file is removed from our directory, wherever that is now (through its descriptor)
        owned = self.lost() is None
        try:
            if self._dir_fd is not None and os.stat(LOCK_FILE, dir_fd=self._dir_fd).st_ino == (
                os.fstat(self._fd).st_ino
            ):
                os.unlink(LOCK_FILE, dir_fd=self._dir_fd)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        if not owned:
            return
        try:
            for name in sorted(set(os.listdir(self.output_dir)) - self._entries):
                _remove_empty_dirs(self.output_dir / name)
        except OSError:  # output_dir removed or unreadable: nothing of ours to clean
            pass
        for path in reversed(self._created):
            try:
                path.rmdir()  # only if empty
            except OSError:
                break

    def __del__(self) -> None:
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _fd_path(fd: int) -> Optional[str]:
    """Where the directory open as ``fd`` is now (Linux's /proc), None if unknown or deleted."""
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return None if where.endswith(" (deleted)") else where


def _remove_empty_dirs(path: Path) -> None:
    """Remove ``path`` if it is a directory (not a link) holding nothing but empty directories."""
    if path.is_symlink() or not path.is_dir():
        return
    for child in path.iterdir():
        _remove_empty_dirs(child)
    try:
        path.rmdir()  # only if empty
    except OSError:
        pass


def run_config_of(output_dir: Path) -> Optional[Dict[str, Any]]:
    """The resolved config recorded by the run that holds ``output_dir``'s lock (None without)."""
    record = read_lock(output_dir)
    return None if record is None else record.get("config")


def checkpoints_in(output_dir: Path) -> List[str]:
    """The names of the checkpoint directories (``epoch_N``, ``step_N``, complete or not) in
    ``output_dir``, in step order."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for path in out.iterdir():
        prefix, _, number = path.name.partition("_")
        if path.is_dir() and prefix in ("epoch", "step") and number.isdigit():
            found.append((int(number), prefix, path.name))
    return [name for _, _, name in sorted(found)]


def refuse_used_output_dir(cfg: DictConfig) -> None:
    """Refuse a fresh run (``resume_from_checkpoint`` not set) into an ``output_dir`` that
    already holds checkpoints: they are another run's, and a fresh run would prune them, mix
    with them, and a later resume would continue the wrong one.

    Raises:
        ConfigKeyError: naming the directory, its checkpoints and the two ways out.
    """
    if bool(cfg.get("resume_from_checkpoint", False)):  # as the recipes read it
        return
    out = Path(str(cfg.output_dir)).expanduser()
    found = checkpoints_in(out)
    if found:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        raise ConfigKeyError(
            f"output_dir {out} already holds another run's checkpoints ({shown}); a fresh run "
            "would mix with them. Continue that run with resume_from_checkpoint=True, or give "
            "another output_dir"
        )


def claim(cfg: DictConfig, *, lock: bool = True, trains: bool = True) -> Optional[RunLock]:
    """Check ``output_dir`` against what ``cfg`` reads, verify the squash checkpoints it reads
    (:func:`squash.runs.manifest.verify_inputs`), refuse a fresh training run into a
    directory holding checkpoints (:func:`refuse_used_output_dir`) and, with ``lock``, take its
    lock. Call it before anything is written (logs, the config copy, checkpoints); on the
    non-zero ranks of a distributed run pass ``lock=False`` (rank 0 owns the directory).
    ``trains=False`` (an evaluation, which writes no checkpoints) skips the used-directory check.

    Returns:
        Optional[RunLock]: the lock to :meth:`~RunLock.release` at cleanup (None without ``lock``).

    Raises:
        ConfigKeyError: ``output_dir`` overlaps something the run reads, or holds checkpoints
            a fresh training run would mix with.
        CheckpointIntegrityError: a squash checkpoint it reads does not match its checkpoint.json.
        OutputDirInUseError: another live run owns ``output_dir`` (a ``RuntimeError``).
        OSError: ``output_dir`` cannot be written.
    """
    out = check_output_dir(cfg)
    manifest.verify_inputs(cfg)
    if not lock:
        if trains:
            refuse_used_output_dir(cfg)
        return None
    # the lock first, so that a live run in the directory is named as such
    run_lock = RunLock(out, OmegaConf.to_container(cfg, resolve=True), base=_base_record(cfg),
                       inputs=input_record(cfg))
    if trains:
        try:
            refuse_used_output_dir(cfg)
        except ConfigKeyError:
            run_lock.release()  # removes the lock file: the directory is as it was
            raise
    return run_lock


def _base_record(cfg: DictConfig) -> Optional[Dict[str, Any]]:
    """:func:`squash.runs.manifest.directory_record` of ``checkpointer.checkpoint_dir``
    (None without one): what an export or chat merging an adapter-only checkpoint checks."""
    base = _get(cfg, "checkpointer.checkpoint_dir")
    if not isinstance(base, str) or not Path(base).is_dir():
        return None
    return {"key": "checkpointer.checkpoint_dir", **manifest.directory_record(Path(base))}


def input_record(cfg: DictConfig) -> Dict[str, Dict[str, Any]]:
    """``{key: {"path", "sha256", "size"}}`` of each file (not directory) the config reads
    besides the base model (:func:`read_paths`: dataset files, tokenizer files), recorded when a
    run starts so that a resume notices a file edited in place
    (:func:`squash.runs.resume.check_inputs`)."""
    record = {}
    for key, path, is_dir in read_paths(cfg):
        if not is_dir and Path(path).is_file():
            f = Path(path).expanduser().resolve()
            record[key] = {"path": str(f), "sha256": manifest.file_sha256(f),
                           "size": f.stat().st_size}  # fmt: skip
    return record
