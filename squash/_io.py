"""Writing a directory atomically: the one implementation squash has, below every package that
writes checkpoints (the recipes' :mod:`squash.runs.checkpoint`, OPT's checkpointer); and a
config block as plain containers for the JSON files they write (:func:`to_plain`)."""

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, List

from omegaconf import DictConfig, ListConfig, OmegaConf

_TMP_PREFIX = ".squash-tmp-"
log = logging.getLogger(__name__)


def to_plain(node: Any) -> Any:
    """A config block as plain Python containers (for JSON files)."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Write the directory ``final`` atomically: the one implementation squash has.

    Yields an empty hidden temporary directory in ``final``'s parent (created if need be). When
    the block ends without an error, every file in it is flushed to disk and given the
    permissions the umask allows, and it is renamed to ``final``, replacing an existing
    ``final`` (moved aside first, removed after). On an error it is removed and ``final`` is
    as it was. What a process killed midway leaves, :func:`clean_stale_temporaries` undoes.

    Args:
        final (Path): the directory to write.

    Yields:
        Path: the directory to write into.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}.", dir=final.parent))
    try:
        yield work
        _publish(work)
        _replace_dir(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone already once renamed


def _publish(path: Path) -> None:
    """Flush every file to disk and give it (and ``path``) the permissions the umask allows
    (mkdtemp and some writers create them private to the user)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in path.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~umask)
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        elif f.is_dir():
            f.chmod(0o777 & ~umask)
    path.chmod(0o777 & ~umask)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and removed after."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.with_name(f"{_TMP_PREFIX}{dst.name}.old")
    if old.exists():
        shutil.rmtree(old)
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def clean_stale_temporaries(output_dir: Path) -> List[str]:
    """Undo what an :func:`atomic_directory` killed midway left in ``output_dir``: remove
    half-written temporary directories, and restore a directory that was moved aside when its
    replacement never arrived (only a complete directory is ever moved aside). Returns what was
    done, one line per directory. One process writes to ``output_dir`` at a time."""
    done = []
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return done
    for path in sorted(output_dir.glob(f"{_TMP_PREFIX}*")):
        if path.name.endswith(".old") and path.is_dir():
            target = output_dir / path.name[len(_TMP_PREFIX) : -len(".old")]
            if not target.exists():
                os.replace(path, target)
                done.append(f"restored {target.name} from an interrupted replacement")
                continue
        shutil.rmtree(path, ignore_errors=True)
        done.append(f"removed the incomplete {path.name}")
    for line in done:
        log.warning("%s: %s", output_dir, line)
    return done


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
