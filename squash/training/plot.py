"""A picture of a run: ``output_dir/training.png``, drawn from the run's own log files.

Panels, one above the other on the optimizer step: the training loss at each logged step with
the held-out loss at each evaluation; the held-out exact match (%) at each evaluation, when the
run counted one; the learning rate. A recipe keeps it up to date through :class:`TrainingPlot`
(at each evaluation and epoch end, and once more when the run stops); ``squash plot
OUTPUT_DIR`` redraws it from the logs of a finished or killed run.

The logs are torchtune's ``DiskLogger`` files, lines ``Step N | name:value name:value ``, one
file per start of the run (``log_<unix time>.txt``). Reading them (:func:`parse_log`,
:func:`merge_logs`, :func:`read_logs`) needs no matplotlib; drawing (:func:`figure`,
:func:`write_picture`) imports it (the ``plot`` extra: ``pip install "squash[plot]"``).
"""

import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from squash import _temporaries

PICTURE = "training.png"
HINT = (
    'training.png needs matplotlib, which is not installed: pip install "squash[plot]" '
    "(squash plot OUTPUT_DIR then draws it from a run's logs)"
)
# the keys a recipe logs at each held-out evaluation (TrainingPlot.evaluated)
HELDOUT_LOSS = "heldout_loss"
HELDOUT_EXACT_MATCH = "heldout_exact_match_pct"

_STEP_LINE = re.compile(r"Step (\d+) \| (.*)")
_LOG_FILE = re.compile(r"log_(\d+)\.txt")
_TMP_PREFIX = f".{PICTURE}."

Series = Dict[str, Dict[int, float]]  # key -> {step: value}, steps ascending


def parse_log(text: str) -> List[Tuple[int, Dict[str, float]]]:
    """The ``(step, {name: value})`` records of one log file's text, in file order.

    Values that are not numbers are left out, and so is a last line without its newline (what a
    run killed while writing it left: its last number may be cut short).
    """
    records = []
    for line in text.split("\n")[:-1]:
        m = _STEP_LINE.fullmatch(line.rstrip())
        if m is None:
            continue
        fields = {}
        for item in m.group(2).split():
            name, _, value = item.partition(":")
            try:
                fields[name] = float(value)
            except ValueError:
                continue
        if fields:
            records.append((int(m.group(1)), fields))
    return records


def merge_logs(texts: Iterable[str]) -> Series:
    """One series per logged name from the texts of a run's log files, oldest first.

    A resumed run starts a new file and repeats the steps after the checkpoint it resumed from,
    so each file continues the ones before it: from the first step at which a file logs a name,
    its values of that name replace the earlier files' (the last write wins), and a curve never
    mixes two starts' values past the resume point.
    """
    series: Series = {}
    for text in texts:
        records = parse_log(text)
        first: Dict[str, int] = {}
        for step, fields in records:
            for name in fields:
                first.setdefault(name, step)
        for name, start in first.items():
            old = series.setdefault(name, {})
            for step in [s for s in old if s >= start]:
                del old[step]
        for step, fields in records:
            for name, value in fields.items():
                series[name][step] = value
    return {name: dict(sorted(values.items())) for name, values in series.items()}


def log_files(log_dir: Path) -> List[Path]:
    """The ``*.txt`` log files in ``log_dir``, oldest first: by the unix time in DiskLogger's
    ``log_<time>.txt`` names (a file named otherwise: its modification time)."""

    def started(path: Path) -> Tuple[int, str]:
        m = _LOG_FILE.fullmatch(path.name)
        return (int(m.group(1)) if m else int(path.stat().st_mtime), path.name)

    return sorted((p for p in Path(log_dir).glob("*.txt") if p.is_file()), key=started)


def read_logs(log_dir: Path) -> Series:
    """:func:`merge_logs` of the log files in ``log_dir``."""
    return merge_logs(p.read_text(errors="replace") for p in log_files(log_dir))


def log_dir_of(output_dir: Path) -> Path:
    """Where a run in ``output_dir`` logged: ``metric_logger.log_dir`` of the config copy the run
    wrote (``torchtune_config.yaml``, ``${output_dir}`` read as ``output_dir``) when that
    directory exists, else ``output_dir/logs``."""
    output_dir = Path(output_dir)
    copy = output_dir / "torchtune_config.yaml"
    if copy.is_file():
        from omegaconf import OmegaConf

        try:
            cfg = OmegaConf.load(copy)
            cfg.output_dir = str(output_dir)
            named = OmegaConf.select(cfg, "metric_logger.log_dir",
                                     throw_on_resolution_failure=False)  # fmt: skip
        except Exception:  # an unreadable copy: the default place
            named = None
        if isinstance(named, str) and Path(named).is_dir():
            return Path(named)
    return output_dir / "logs"


def figure(series: Series, title: str = "") -> Any:
    """The picture of ``series`` as a matplotlib ``Figure`` (no pyplot, no global state).

    Lines carry labels: ``training loss``, ``held-out loss``, ``held-out exact match``,
    ``learning rate``; a series not logged is not drawn, nor is the exact-match panel without one.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    rows = ["loss"] + (["exact"] if series.get(HELDOUT_EXACT_MATCH) else []) + ["lr"]
    fig = Figure(figsize=(8, 2.4 * len(rows) + 0.6), layout="constrained")
    axes = dict(zip(rows, fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]))

    def line(ax: Any, name: str, label: str, style: str = "-", color: str = "C0") -> None:
        values = series.get(name)
        if values:
            ax.plot(list(values), list(values.values()), style, label=label, color=color)

    line(axes["loss"], "loss", "training loss")
    line(axes["loss"], HELDOUT_LOSS, "held-out loss", "o-", "C1")  # held-out: orange points
    axes["loss"].set_ylabel("loss (nats/token)")
    if "exact" in rows:
        line(axes["exact"], HELDOUT_EXACT_MATCH, "held-out exact match", "o-", "C1")
        axes["exact"].set_ylabel("exact match (%)")
        axes["exact"].set_ylim(-2, 102)
    line(axes["lr"], "lr", "learning rate")
    axes["lr"].set_ylabel("learning rate")
    axes["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    axes["lr"].set_xlabel("optimizer step")
    for ax in axes.values():
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def write_picture(output_dir: Path, series: Optional[Series] = None) -> Path:
    """Draw ``output_dir/training.png`` from ``series`` (default: the run's logs, found with
    :func:`log_dir_of`), atomically: a temporary file beside it, renamed over it.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: nothing was logged (no log files, or none with a step in them).
    """
    output_dir = Path(output_dir)
    if series is None:
        series = read_logs(log_dir_of(output_dir))
    if not series:
        raise ValueError(f"no logged steps in {log_dir_of(output_dir)}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure(series, title=output_dir.resolve().name)
    FigureCanvasAgg(fig)
    _temporaries.remove_stale(output_dir, _TMP_PREFIX)  # what a killed run's draw left
    fd, tmp = tempfile.mkstemp(prefix=_temporaries.owned_prefix(_TMP_PREFIX), dir=output_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100, metadata={"Software": None})
        os.chmod(tmp, 0o644)
        os.replace(tmp, output_dir / PICTURE)
    except BaseException:
        os.unlink(tmp)
        raise
    return output_dir / PICTURE


def have_matplotlib() -> bool:
    """Whether matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


class TrainingPlot:
    """What a recipe calls to keep ``output_dir/training.png`` up to date.

    The picture is drawn from the files of the run's metric logger (torchtune's ``DiskLogger``),
    so a resumed run's picture continues the killed run's. Without matplotlib, or with a logger
    that writes no file, it says so once and draws nothing; a picture that fails to draw is a
    warning, never the end of a run.

    Args:
        output_dir (Path): the run's ``output_dir``.
        metric_logger: the run's metric logger; None on the ranks that do not log (each call is
            then a no-op).
    """

    def __init__(self, output_dir: Path, metric_logger: Optional[Any]) -> None:
        self._output_dir = Path(output_dir)
        self._logger = metric_logger
        self._log_file: Optional[Path] = None
        self._drawn: Optional[Tuple[int, int]] = None  # the log file's (size, mtime) last drawn
        if metric_logger is None:
            return
        path_fn = getattr(metric_logger, "path_to_log_file", None)
        if path_fn is None:
            print(f"training.png: drawn from DiskLogger's log files; metric_logger is "
                  f"{type(metric_logger).__name__}, so this run draws no picture", flush=True)  # fmt: skip
        elif not have_matplotlib():
            print(HINT, flush=True)
        else:
            self._log_file = Path(path_fn())

    def evaluated(self, result: Dict[str, Any], step: int) -> None:
        """Log a held-out evaluation's loss and exact match (``HeldoutEvaluator.report``'s
        result) at ``step``, then draw."""
        if self._logger is None:
            return
        logs = {HELDOUT_LOSS: result["loss"]}
        if result.get("exact_match_of"):
            logs[HELDOUT_EXACT_MATCH] = 100.0 * result["exact_match"] / result["exact_match_of"]
        self._logger.log_dict(logs, step=step)
        self.draw()

    def draw(self) -> None:
        """Redraw the picture if the run logged something since it was last drawn."""
        if self._log_file is None:
            return
        try:
            stat = self._log_file.stat()
            if stat.st_size == 0 or (stat.st_size, stat.st_mtime_ns) == self._drawn:
                return
            write_picture(self._output_dir, read_logs(self._log_file.parent))
            self._drawn = (stat.st_size, stat.st_mtime_ns)
        except Exception as err:  # noqa: BLE001  (a picture never stops a run)
            print(f"training.png: not drawn: {' '.join(str(err).split())}", file=sys.stderr,
                  flush=True)  # fmt: skip
