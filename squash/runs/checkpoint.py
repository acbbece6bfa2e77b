"""Checkpoints of a squash fine-tune: what one directory holds, written atomically, and resume.

A checkpoint directory (``output_dir/epoch_N`` at the end of epoch ``N``, ``output_dir/step_N``
after global step ``N``) holds, all written into a hidden temporary directory inside
``output_dir`` that is renamed into place only when complete (a run killed at any moment leaves
either the whole directory or none; :func:`atomic_directory` is squash's one atomic writer, which
the OPT checkpointer uses too, and :func:`clean_stale_temporaries` undoes an interrupted one):

- ``squash_adapter.safetensors`` + ``squash_adapter_config.json``: the adapter as squash holds
  it (FFI ``values`` and ``indices``, dense factors as ``weight``), keyed as in
  ``model.state_dict()``, and how to rebuild the model (the ``model`` config block).
- ``adapter/adapter_model.safetensors`` + ``adapter/adapter_config.json``: the adapter in PEFT's
  format (``PeftModel.from_pretrained(model, "<dir>/adapter")``), every sparse factor written
  dense (:func:`squash.export.adapters.dense_adapter`), written by the model's checkpointer
  (which knows the family's key names); ``adapter/adapter_model.pt`` holds what the
  checkpointer was given: the same dense factors with torchtune's keys. In a subdirectory, because transformers would apply an adapter it finds
  beside merged weights a second time.
- unless ``adapter_only``: the merged model (:func:`squash.export.adapters.merged_weights`,
  NF4 bases dequantized) in Hugging Face format, with ``config.json`` and the tokenizer files.
- ``recipe_state.pt``: optimizer, lr scheduler, RNG and data position, for resume.
- ``checkpoint.json``: epoch and global step, the counters, the sha256 and size of every other
  file and the run's config (:mod:`squash.runs.manifest`); written last, so a directory with
  it is complete, and resume and ``squash_eval`` verify the directory against it.
"""

import copy
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from squash._io import atomic_directory, clean_stale_temporaries  # noqa: F401  (also here)
from squash.runs import manifest, run_lock

if TYPE_CHECKING:
    from squash.export.adapters import Exports

log = logging.getLogger(__name__)

SQUASH_ADAPTER_FILE = "squash_adapter.safetensors"
SQUASH_ADAPTER_CONFIG_FILE = "squash_adapter_config.json"
RECIPE_STATE_FILE = "recipe_state.pt"
CHECKPOINT_META_FILE = "checkpoint.json"
PEFT_SUBDIR = "adapter"


# ---- writing --------------------------------------------------------------------------------------
def _save_tensors(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path)


@manifest.names_write_errors
def write_checkpoint(
    output_dir: Path,
    name: str,
    *,
    checkpointer: Any,
    exports: "Exports",
    recipe_state: Dict[str, Any],
    epoch: int,
    global_step: int,
    adapter_only: bool,
) -> Path:
    """Write the checkpoint directory ``output_dir/name`` atomically (see the module docstring).

    The model's ``checkpointer`` (``OPTCheckpointer`` or torchtune's HF checkpointer, anything that
    writes ``<its output_dir>/epoch_{epoch}``) writes the merged model and the PEFT adapter into a
    temporary directory; squash's files and the recipe state are added; the directory is renamed
    into place, replacing an older one of the same name.

    Args:
        output_dir (Path): the run's output directory.
        name (str): ``epoch_N`` or ``step_N``.
        checkpointer (Any): the model's checkpointer.
        exports (Exports): what :func:`squash.export.adapters.checkpoint_exports` made of the
            model: squash's adapter and config, and what ``checkpointer.save_checkpoint`` takes
            (``model``, ``adapter``, ``adapter_config``).
        recipe_state (Dict[str, Any]): :func:`squash.runs.resume.recipe_state`.
        epoch (int): the epoch recorded in ``checkpoint.json``.
        global_step (int): the global step recorded there (resume picks the highest).
        adapter_only (bool): leave out the merged model.

    Returns:
        Path: the checkpoint directory.

    Raises:
        OutputDirLostError: ``output_dir`` is no longer the directory the run locked (checked
            before anything is written and again before the rename): nothing is left there.
    """
    output_dir = Path(output_dir)
    run_lock.check_owned(output_dir)
    with atomic_directory(output_dir / name) as work:
        _save_hf_files(checkpointer, exports.checkpointer_state, work, adapter_only)
        # The PEFT adapter goes one level down: transformers' from_pretrained on a directory with
        # an adapter_config.json would load the base named there and apply the adapter again on
        # top of the merged weights.
        (work / PEFT_SUBDIR).mkdir()
        for f in list(work.iterdir()):
            if f.is_file() and f.name.startswith("adapter_"):
                os.replace(f, work / PEFT_SUBDIR / f.name)
        _save_tensors(exports.squash_adapter, work / SQUASH_ADAPTER_FILE)
        (work / SQUASH_ADAPTER_CONFIG_FILE).write_text(
            json.dumps(exports.squash_adapter_config, indent=2, sort_keys=True)
        )
        torch.save(recipe_state, work / RECIPE_STATE_FILE)
        meta = {"epoch": epoch, "global_step": global_step}
        # hashes: written last
        manifest.write_meta(work, meta, recipe_state, run_lock.read_lock(output_dir))
        run_lock.check_owned(output_dir)  # still ours, or the temporary is removed unrenamed
    return output_dir / name


def _save_hf_files(checkpointer: Any, state: Dict[str, Any], directory: Path, adapter_only: bool) -> None:
    """Have the model's checkpointer write its Hugging Face files (merged model, PEFT adapter,
    config and tokenizer files) into ``directory``.

    torchtune's checkpointers take no target directory: they write ``<output_dir>/epoch_N``. A
    shallow copy of the checkpointer is pointed at ``directory``, so the recipe's checkpointer
    is never changed, whatever happens during the write; what it writes to
    ``directory/epoch_0`` is moved up into ``directory``.
    """
    writer = copy.copy(checkpointer)
    writer._output_dir = Path(directory)
    writer.save_checkpoint(state, epoch=0, intermediate_checkpoint=False, adapter_only=adapter_only)
    inner = Path(directory) / "epoch_0"
    if not inner.is_dir():
        raise RuntimeError(f"{type(checkpointer).__name__} wrote nothing into {inner}")
    for f in list(inner.iterdir()):
        os.replace(f, Path(directory) / f.name)
    inner.rmdir()


def prune_step_checkpoints(output_dir: Path, keep_last_n: Optional[int]) -> List[Path]:
    """Delete all but the newest ``keep_last_n`` complete ``step_N`` directories (None keeps
    all). Directories without a readable ``checkpoint.json`` are neither counted nor deleted."""
    if keep_last_n is None:
        return []
    run_lock.check_owned(output_dir)  # never another run's step checkpoints
    steps = sorted(
        (n, path) for n, path in _numbered(Path(output_dir), "step_") if read_meta(path)
    )
    doomed = [path for _, path in steps[: max(0, len(steps) - keep_last_n)]]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _numbered(output_dir: Path, prefix: str) -> List[Tuple[int, Path]]:
    found = []
    for path in output_dir.glob(f"{prefix}*"):
        suffix = path.name[len(prefix) :]
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return found


# ---- reading --------------------------------------------------------------------------------------
def latest_checkpoint(output_dir: Path, *, refuse_damaged: bool = False) -> Optional[Path]:
    """The complete checkpoint directory (``epoch_N`` or ``step_N``) with the highest global
    step in ``output_dir``, or None. An epoch checkpoint wins a tie with a step checkpoint.
    squash's one search for the newest checkpoint (resume calls it with ``refuse_damaged``).

    Args:
        output_dir (Path): a run's output directory.
        refuse_damaged (bool): raise on an ``epoch_N``/``step_N`` directory whose
            ``checkpoint.json`` is missing or damaged instead of skipping it (resume: skipping
            it would resume an older checkpoint without a word). Default False.

    Raises:
        CheckpointIntegrityError: with ``refuse_damaged``, naming the damaged
            ``checkpoint.json`` and what is wrong with it.
    """
    best, best_key = None, None
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    for prefix in ("step_", "epoch_"):
        for _, path in _numbered(output_dir, prefix):
            meta = read_meta(path)
            if meta is None:
                if refuse_damaged:
                    manifest.read_verified_meta(path)  # raises, naming what is wrong
                    raise manifest.CheckpointIntegrityError(
                        f"{path / manifest.META_FILE} has no global_step; the checkpoint is damaged"
                    )
                continue
            key = (int(meta["global_step"]), prefix == "epoch_")
            if best_key is None or key > best_key:
                best, best_key = path, key
    return best


def read_meta(path: Path) -> Optional[Dict[str, Any]]:
    """``checkpoint.json`` of a checkpoint directory, or None if it is absent or unreadable."""
    try:
        meta = json.loads((Path(path) / CHECKPOINT_META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("global_step"), int):
        return None
    return meta


def load_squash_adapter(path: Path) -> Dict[str, torch.Tensor]:
    """Read ``squash_adapter.safetensors`` from a checkpoint directory (or the file itself).

    Raises:
        FileNotFoundError: if it does not exist.
        ValueError: if it cannot be read as safetensors.
    """
    path = Path(path)
    if path.is_dir():
        path = path / SQUASH_ADAPTER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"No squash adapter at {path}")
    try:
        return load_file(path)
    except Exception as e:
        raise ValueError(f"Cannot read the squash adapter {path}: {e}") from e


def check_adapter_fits(
    own: Dict[str, torch.Tensor], adapter: Dict[str, torch.Tensor], source: Path
) -> None:
    """Check that ``adapter`` holds exactly the keys of ``own`` (a model's adapter tensors, or
    its initial adapter), each with its shape.

    Raises:
        ValueError: naming ``source`` and the missing, unexpected or wrongly shaped keys.
    """
    expected = set(own)
    missing, unexpected = sorted(expected - adapter.keys()), sorted(adapter.keys() - expected)
    wrong = sorted(
        f"{k}: {tuple(adapter[k].shape)} in the file, {tuple(own[k].shape)} in the model"
        for k in expected & adapter.keys()
        if tuple(adapter[k].shape) != tuple(own[k].shape)
    )
    if missing or unexpected or wrong:
        raise ValueError(
            f"The adapter in {source} does not fit the model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}, wrong shapes {wrong[:5]}"
        )


def load_adapter_into(model: nn.Module, adapter: Dict[str, torch.Tensor], source: Path) -> None:
    """Load adapter tensors into ``model``, checking that they are exactly its adapter tensors.

    Shapes, dtypes of indices and the FFI rules are checked by the modules' own state-dict
    loading (``FFILinear`` validates its indices).

    Raises:
        ValueError: naming the missing, unexpected or wrongly shaped keys, or the broken FFI rule.
    """
    from squash.export.adapters import adapter_state

    check_adapter_fits(adapter_state(model), adapter, source)
    try:
        model.load_state_dict(adapter, strict=False)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"The adapter in {source} is invalid: {e}") from e


def load_recipe_state(path: Path) -> Dict[str, Any]:
    """``recipe_state.pt`` of a checkpoint directory, through ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: if it does not exist.
        ValueError: if it cannot be loaded safely or is not a dict.
    """
    path = Path(path) / RECIPE_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"No recipe state at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"Cannot load {path} with torch.load(weights_only=True): {e}") from e
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a dict")
    return state


# ---- RNG ------------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> Dict[str, Any]:
    """Python's and torch's RNG states (CPU, and the accelerator's when ``device`` is one)."""
    state = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)
