"""What the benchmark scripts share: dtypes by name, device sync and one timer, the host's
description, model sizes (squash's own builders' sizes), the adapted shapes, the seed statistics
and the PNG writer.

A script imports it as ``import common`` (or ``from common import ...``): run as
``python benchmarks/X.py`` its own folder is first on ``sys.path``; the tests put this folder
there once (``tests/benchmarks/conftest.py``). The scripts import each other the same way.
"""

import argparse
import functools
import importlib
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from squash.models.opt._model_builders import _OPT_SIZES
from squash.models.smollm2._model_builders import SMOLLM2_135M

__all__ = ["DTYPES", "OPT_350M", "SMOLLM2_135M", "adapted_shapes", "cpu_flags", "cpu_model",
           "has_matplotlib", "host", "kernels", "machine_line", "make_timer", "mean_std",
           "model_script", "pyplot", "save_png", "sync", "welch"]  # fmt: skip

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# ---- model sizes ----------------------------------------------------------------------------
# squash's builders' sizes (`opt_350m`, `smollm2_135m`), with `num_layers`: all of the model's.
OPT_350M = dict(_OPT_SIZES["350m"])


def model_script(argv: list | None, doc: str, models: dict):
    """One script for every model behind ``--model`` (``quality.py``, ``distill.py``: the SmolLM2
    runs live in a sibling module).

    Args:
        argv (Optional[list]): the arguments (default: ``sys.argv[1:]``); ``--model`` may
            stand anywhere in them.
        doc (str): the calling script's docstring (its first line describes the parser).
        models (dict): ``{name: (sibling module or None, help)}``; the first is the default, and
            None marks the calling script's own model.

    Returns:
        ``(main, parser)``: ``main`` is the sibling's ``main`` bound to the other arguments, or
        None for the calling script's own model; ``parser`` is the calling script's parser with
        ``--model`` already added (so ``--help`` lists the choices). A bad ``--model`` exits as
        argparse does.
    """
    default = next(iter(models))
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", choices=tuple(models), default=default)
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--model", choices=tuple(models), default=default,
                        help="; ".join(f"{k}: {h}" for k, (_, h) in models.items()))
    sibling = models[known.model][0]
    if sibling is None:
        return None, parser
    return functools.partial(importlib.import_module(sibling).main, rest), parser


def adapted_shapes(family: str, layers: int = None, sizes: dict = None) -> list:
    """``(in, out)`` of every adapted linear, layer by layer: OPT's q, k, v, output, fc1, fc2;
    SmolLM2's (Llama's) q, k, v, output, w1, w2, w3 (torchtune's order: gate, down, up).

    Args:
        family (str): ``"opt350m"`` or ``"smollm2"``.
        layers (int): decoder layers (default: all of the model's).
        sizes (dict): the model's sizes (default :data:`OPT_350M` or :data:`SMOLLM2_135M`).
    """
    m = sizes or (OPT_350M if family == "opt350m" else SMOLLM2_135M)
    d, f = m["embed_dim"], m["intermediate_dim"]
    layers = layers or m["num_layers"]
    if family == "opt350m":
        return [(d, d)] * 4 * layers + [(d, f), (f, d)] * layers
    kv = m["num_kv_heads"] * d // m["num_heads"]
    return [(d, d), (d, kv), (d, kv), (d, d), (d, f), (f, d), (d, f)] * layers


# ---- devices and timing ---------------------------------------------------------------------
def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_timer(device: str, events: bool = False) -> Callable[[Callable[[], object]], float]:
    """A function that runs ``fn`` once and returns its time in milliseconds: the wall clock
    between two device syncs, or, on a CUDA device with ``events``, the GPU's time between two
    CUDA events around the call. Warm-up, repeats and the statistic over them are the caller's."""
    if events and device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def timed(fn):
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return timed

    def timed(fn):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return (time.perf_counter() - t0) * 1e3

    return timed


# ---- the host -------------------------------------------------------------------------------
def _cpuinfo(key: str) -> str:
    """The first ``key`` line's value in ``/proc/cpuinfo`` (``""`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == key:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name, or (without ``/proc/cpuinfo``) what ``platform`` knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where it has none)."""
    return _cpuinfo("flags").split()


def machine_line(device: str, dtype: torch.dtype) -> str:
    """One line naming the hardware, thread count, torch version and dtype (the timing tables'
    line; ``finetune_plot.py`` reads it back: its fields are ``; ``-separated)."""
    if device.startswith("cuda"):
        hw = f"GPU {torch.cuda.get_device_name(torch.device(device))}"
        if torch.version.hip is not None:
            hw += f" (ROCm {torch.version.hip})"
        elif torch.version.cuda is not None:
            hw += f" (CUDA {torch.version.cuda})"
        hw += f", fp32 matmul precision {torch.get_float32_matmul_precision()}"
    else:
        hw = (f"CPU {cpu_model()}, {os.cpu_count()} logical cores, "
              f"{torch.get_num_threads()} torch threads")  # fmt: skip
    return f"{hw}; torch {torch.__version__}; dtype {str(dtype).replace('torch.', '')}"


def host() -> str:
    """The CPU host of a quality run: model (torch's ISA), CPUs, torch threads, torch and Python
    versions (``quality_curves.py`` groups its runs' sessions by this text)."""
    return (f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} CPUs, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
            f"Python {platform.python_version()}")  # fmt: skip


def kernels(device: str) -> str:
    """``"<backend> <ISA or GPU arch>"`` of squash's kernels for ``device`` (as loaded so far)."""
    import squash.ops

    st = squash.ops.status().get("cpu" if device == "cpu" else "cuda", {})
    return f"{st.get('backend', '?')} {st.get('isa', st.get('arch', ''))}"


# ---- statistics over seeds ------------------------------------------------------------------
def mean_std(values: list) -> tuple:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def welch(a: list, b: list) -> dict:
    """Welch's t of ``mean(a) - mean(b)``, its Welch-Satterthwaite degrees of freedom and the
    two-sided p; nan where either side has fewer than 2 values or neither has spread."""
    nan = {"t": math.nan, "df": math.nan, "p": math.nan}
    if len(a) < 2 or len(b) < 2:
        return nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return nan
    t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    from scipy.stats import t as student_t

    return {"t": t, "df": df, "p": float(2 * student_t.sf(abs(t), df))}


def recipe_training(arm: dict, lr: float, steps: int, run_dir: Path, *, device: str = "cpu",
                    dtype: str = "fp32", log_every: int = 1) -> dict:  # fmt: skip
    """The training keys of a quality benchmark's ``squash_finetune`` config: one epoch of
    ``steps`` steps, AdamW at ``lr`` without weight decay, a cosine schedule after a tenth of the
    steps' warmup, cross entropy, gradients clipped at 1.0, no compile, activation checkpointing
    or offloading, a DiskLogger in ``run_dir/logs`` every ``log_every`` steps; and the arm's
    ``mask_update`` (if any) until three quarters of the steps."""
    cfg = dict(
        optimizer=dict(_component_="torch.optim.AdamW", lr=lr, weight_decay=0.0),
        lr_scheduler=dict(
            _component_="torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            num_warmup_steps=max(1, steps // 10)),
        loss=dict(_component_="torch.nn.CrossEntropyLoss"),
        epochs=1, max_steps_per_epoch=steps, gradient_accumulation_steps=1, clip_grad_norm=1.0,
        compile=False, device=device, dtype=dtype,
        enable_activation_checkpointing=False, enable_activation_offloading=False,
        metric_logger=dict(_component_="torchtune.training.metric_logging.DiskLogger",
                           log_dir=str(run_dir / "logs")),
        log_every_n_steps=log_every, log_peak_memory_stats=False,
    )  # fmt: skip
    if arm.get("mask_update"):
        cfg["mask_update"] = dict(arm["mask_update"], until_step=max(2, (3 * steps) // 4))
    return cfg


def arm_row(a: dict, lr_fmt: str, edge: str) -> str:
    """One markdown row of a quality table: an arm's name, rank and memory, its lr sweep on
    validation (loss and exact match per lr, the best in bold; "not swept here" for none), the
    best lr with ``edge`` after it, test loss and exact match (mean +/- std) and each seed's test
    loss. Learning rates are written with ``lr_fmt`` (``".0e"``)."""
    cells = []
    for lr_s, r in sorted(a["sweep"].items(), key=lambda kv: float(kv[0])):
        v = f"{float(lr_s):{lr_fmt}}: {r['val']['loss']:.3f} ({r['val']['exact_match']:.2f})"
        cells.append(f"**{v}**" if float(lr_s) == a["best_lr"] else v)
    losses = ", ".join(f"{x:.3f}" for x in a["test_loss"])
    return (f"| {a['name']} | {a['rank']} | {a['vs_budget']:.2f}x | "
            f"{'; '.join(cells or ['not swept here'])} | {a['best_lr']:{lr_fmt}}{edge} | "
            f"{a['test_loss_mean']:.3f} +/- {a['test_loss_std']:.3f} | "
            f"{a['test_em_mean']:.3f} +/- {a['test_em_std']:.3f} | {losses} |")  # fmt: skip


# ---- pictures -------------------------------------------------------------------------------
def has_matplotlib() -> bool:
    """Whether matplotlib (the ``plot`` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> None:
    """``fig`` as a PNG at ``path`` (110 dpi), written to a temporary file and renamed; the
    figure is closed."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
