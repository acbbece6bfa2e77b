"""What a recipe's entry point does around a run: config errors as one line, no empty log
files left by a failed run, and third-party messages squash cannot act on kept quiet.

- :func:`config_errors_in_one_line`: a refusal (a ``ConfigKeyError``, an OmegaConf
  interpolation error, an ``output_dir`` in use, a damaged or unwritable checkpoint) ends the
  run with ``RECIPE: config error: MESSAGE`` (or ``checkpoint error``) on stderr and exit status
  1, not a traceback through torchtune's launcher (``SQUASH_FULL_ERROR=1`` shows it).
- :func:`open_metric_logger`: the run's metric logger and its config copy, made last in set-up.
- :func:`close_metric_logger`: closes the run's metric logger and removes its log file when the
  run wrote nothing into it (a run that failed in set-up).
(Third-party messages squash cannot act on are filtered when squash is imported:
:mod:`squash._quiet`.)
"""

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from squash.config.keys import ConfigKeyError

# Set to 1 for a refusal's traceback instead of its one line (as torchtune's HYDRA_FULL_ERROR).
FULL_ERROR_ENV = "SQUASH_FULL_ERROR"


def one_line(err: BaseException) -> str:
    """An exception's message on one line (OmegaConf's span several)."""
    return " ".join(str(err).split())


@contextmanager
def config_errors_in_one_line(recipe: str) -> Iterator[None]:
    """Run the body; a refusal becomes one line on stderr and exit status 1, not a traceback
    through torchtune's launcher: ``RECIPE: config error: ...`` for a ``ConfigKeyError``, an
    OmegaConf error (an interpolation that does not resolve, a missing mandatory value) or an
    ``output_dir`` in use by another run; ``RECIPE: checkpoint error: ...`` for a damaged
    checkpoint (``CheckpointIntegrityError``) or one that cannot be written (a full disk:
    ``CheckpointWriteError``, naming the checkpoint and the space left); ``RECIPE: error: ...``
    for an ``output_dir`` that is no longer the directory the run locked. With the environment
    variable ``SQUASH_FULL_ERROR=1`` the error is raised as it is, with its traceback.

    Raises:
        SystemExit: status 1, after printing the message.
    """
    from omegaconf.errors import OmegaConfBaseException

    from squash.runs.manifest import CheckpointIntegrityError, CheckpointWriteError
    from squash.runs.run_lock import OutputDirInUseError, OutputDirLostError

    try:
        yield
    except (ConfigKeyError, OmegaConfBaseException, OutputDirInUseError) as err:
        _refuse(recipe, "config error", err)
    except (CheckpointIntegrityError, CheckpointWriteError) as err:
        _refuse(recipe, "checkpoint error", err)
    except OutputDirLostError as err:
        _refuse(recipe, "error", err)


def _refuse(recipe: str, kind: str, err: BaseException) -> None:
    if os.environ.get(FULL_ERROR_ENV, "") not in ("", "0"):
        raise err
    _close_progress_bars()  # the line starts a line of its own, not the end of a bar's
    print(f"{recipe}: {kind}: {one_line(err)}", file=sys.stderr, flush=True)
    raise SystemExit(1) from None


def open_metric_logger(cfg: Any) -> Any:
    """The metric logger of ``cfg.metric_logger``, with the config copy written
    (``torchtune_config.yaml``). Every recipe calls this last in set-up, so a run that stops in
    set-up (a bad value, a model that does not build, a refused resume) leaves no log file and
    no config copy, nor overwrites the copy of the run it refused to resume."""
    from torchtune import config

    from squash.runs.run_lock import check_owned

    check_owned(Path(cfg.output_dir))
    logger = config.instantiate(cfg.metric_logger)
    logger.log_config(cfg)
    return logger


def close_metric_logger(logger: Any) -> None:
    """Close ``logger``; if it wrote to a file that is still empty, remove the file (and its
    directory, when that is left empty)."""
    if logger is None:
        return
    logger.close()
    path_fn = getattr(logger, "path_to_log_file", None)
    if path_fn is None:
        return
    path = Path(path_fn())
    try:
        if path.is_file() and path.stat().st_size == 0:
            path.unlink()
            if not any(path.parent.iterdir()):
                path.parent.rmdir()
    except OSError:  # another process's file appeared, or permissions: leave it
        pass


def _close_progress_bars() -> None:
    """Close the progress bars a run that stops midway leaves open (tqdm's, on stderr)."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except Exception:  # a refusal is printed whatever the bars do
        pass
