"""Temporary files and directories that carry the id of the process writing them, so that the
next run of the same command removes what a killed one left (a live writer's are kept).

A writer names its temporary ``PREFIX<pid>-<random>`` (:func:`owned_prefix`, given to
``tempfile.mkstemp``/``mkdtemp``) and, before it writes, calls :func:`remove_stale` with the same
``PREFIX``: every entry ``PREFIX<pid>-...`` whose process is no longer running on this host is
removed. Entries without a pid (written by an older squash) are left alone.
"""

import logging
import os
import shutil
from pathlib import Path
from typing import List

log = logging.getLogger(__name__)


def owned_prefix(prefix: str) -> str:
    """``prefix`` followed by this process's id and a dash."""
    return f"{prefix}{os.getpid()}-"


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one another user owns counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: Path, prefix: str) -> List[Path]:
    """Remove each ``directory/PREFIX<pid>-*`` whose process ``pid`` is not running.

    Returns:
        List[Path]: what was removed (each also logged as a warning).
    """
    directory = Path(directory)
    removed: List[Path] = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.glob(f"{prefix}*")):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
        log.warning("Removed %s, left by an interrupted run (process %s)", path, pid)
    return removed
