"""A torchtune checkpointer for Hugging Face OPT checkpoints."""

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
from safetensors.torch import load_file, save_file

from squash._checks import check_safetensors_dtypes

from squash.models.opt._convert_weights import (
    HF_PREFIX,
    opt_adapter_layout,
    opt_hf_shapes,
    opt_hf_to_tune,
    opt_tune_to_hf,
    opt_tune_to_peft_adapter_config,
    opt_tune_to_peft_adapter_weights,
)
from squash._io import atomic_directory, clean_stale_temporaries
from squash.modules.adapter import dense_adapter

log = logging.getLogger(__name__)

MODEL_KEY, ADAPTER_KEY, ADAPTER_CONFIG_KEY = "model", "adapter", "adapter_config"
RECIPE_STATE_DIRNAME = "recipe_state"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_NOT_COPIED = re.compile(r".*(\.safetensors|\.bin|\.pt|\.pth|\.index\.json)$|^adapter_")


class OPTCheckpointer:
    """Reads and writes OPT checkpoints in Hugging Face's format, with torchtune's checkpointer
    interface (``load_checkpoint``/``save_checkpoint``, the ``model``, ``adapter``,
    ``adapter_config`` and recipe-state keys of torchtune's LoRA recipes).

    Loading reads ``config.json`` and the weight files (``.safetensors``; ``.bin``/``.pt`` through
    ``torch.load(weights_only=True)``, never a plain ``torch.load``), checks every key and shape
    against the config, and converts to squash's key names. Saving writes, into
    ``output_dir/epoch_{N}``: ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards
    with ``model.safetensors.index.json``) that ``transformers`` loads, the non-weight files of the
    checkpoint dir (``config.json``, tokenizer files), and, given an adapter, ``adapter_model.pt``
    (squash keys, for resuming) plus PEFT's ``adapter_model.safetensors`` and
    ``adapter_config.json``. This class only loads and saves the files: each epoch directory
    (and ``recipe_state``) is written through squash's one atomic writer,
    :func:`squash._io.atomic_directory`, so it is either complete or absent; what
    a save killed midway leaves behind (a hidden temporary directory, or an existing epoch moved
    aside and not yet replaced) is removed, or restored, by
    :func:`~squash._io.clean_stale_temporaries` before each save (the recipes
    also clean up once they own ``output_dir``). One process writes to an ``output_dir`` at a
    time.

    Args:
        checkpoint_dir (str): directory holding ``config.json`` and the weight files.
        checkpoint_files (Union[str, List[str], Dict[str, str]]): weight file names in
            ``checkpoint_dir``, or the name of an index file (``*.index.json``) whose weight map
            lists them, or torchtune's ``{"filename_format": ..., "max_filename": ...}``.
        output_dir (str): where ``epoch_{N}`` and ``recipe_state`` directories are written; must
            not be inside ``checkpoint_dir``.
        model_type (Optional[str]): accepted for config compatibility with torchtune; must be
            None or ``"OPT"``. Default None.
        adapter_checkpoint (Optional[str]): adapter file to resume from, relative to
            ``output_dir``. Default None: the newest ``epoch_{N}/adapter_model.pt`` if any.
        recipe_checkpoint (Optional[str]): recipe state file to resume from, relative to
            ``output_dir``. Default None: ``recipe_state/recipe_state.pt``.
        resume_from_checkpoint (bool): load the adapter and the recipe state too. Default False.
        should_load_recipe_state (bool): torchtune 0.6's name for ``resume_from_checkpoint``.
            Default False.
        max_shard_size (int): largest safetensors shard written, in bytes. Default 5 GiB.

    Raises:
        FileNotFoundError: if ``checkpoint_dir``, its ``config.json``, a weight file or a file to
            resume from does not exist.
        ValueError: if ``model_type`` is not OPT, ``output_dir`` is inside ``checkpoint_dir``,
            ``checkpoint_files`` is empty or names a file of unknown format or outside
            ``checkpoint_dir``, or ``config.json`` or an index file cannot be read or is not an
            OPT config squash supports (each naming the file).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        checkpoint_files: Union[str, List[str], Dict[str, str]],
        output_dir: str,
        model_type: Optional[str] = None,
        adapter_checkpoint: Optional[str] = None,
        recipe_checkpoint: Optional[str] = None,
        resume_from_checkpoint: bool = False,
        should_load_recipe_state: bool = False,
        max_shard_size: int = 5 * 1024**3,
    ) -> None:
        if model_type is not None and str(model_type).upper() != "OPT":
            raise ValueError(f"OPTCheckpointer reads OPT only, got model_type={model_type!r}")
        self._checkpoint_dir = Path(checkpoint_dir)
        if not self._checkpoint_dir.is_dir():
            raise FileNotFoundError(f"Checkpoint directory not found: {self._checkpoint_dir}")
        config_path = self._checkpoint_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"No config.json in checkpoint_dir {self._checkpoint_dir}")
        self._config = _read_json(config_path, "an OPT config.json")
        try:
            self._expected_shapes = opt_hf_shapes(self._config)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{config_path} is not an OPT config squash supports: {e}") from e

        self._output_dir = Path(output_dir)
        ckpt, out = self._checkpoint_dir.resolve(), self._output_dir.resolve()
        if out == ckpt or ckpt in out.parents:
            raise ValueError(f"output_dir {out} must not be inside checkpoint_dir {ckpt}")
        self._output_dir.mkdir(parents=True, exist_ok=True)
        # no clean-up here: a checkpointer built by another process (an eval, a second run that
        # its lock then refuses) must not remove a live run's temporaries; saves clean up
        self._max_shard_size = max_shard_size
        self._checkpoint_paths = self._resolve_checkpoint_files(checkpoint_files)

        self._resume = resume_from_checkpoint or should_load_recipe_state
        self._adapter_path = self._recipe_path = None
        if self._resume:
            self._adapter_path = self._resume_path(
                adapter_checkpoint, "adapter_model.pt", required=adapter_checkpoint is not None
            )
            self._recipe_path = self._resume_path(
                recipe_checkpoint, f"{RECIPE_STATE_DIRNAME}/recipe_state.pt", required=True
            )

    def _resolve_checkpoint_files(self, files) -> List[Path]:
        if isinstance(files, Mapping):  # torchtune's FormattedCheckpointFiles
            fmt, n = files["filename_format"], files["max_filename"]
            files = [fmt.format(str(i).zfill(len(n)), n) for i in range(1, int(n) + 1)]
        elif isinstance(files, (str, os.PathLike)):
            files = [files]
        files = list(files)
        if not files:
            raise ValueError("checkpoint_files is empty")
        if len(files) == 1 and str(files[0]).endswith(".index.json"):
            index = self._inside_checkpoint_dir(files[0])
            if not index.is_file():
                raise FileNotFoundError(f"Checkpoint index file not found: {index}")
            weight_map = _read_json(index, "a checkpoint index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise ValueError(
                    f"Checkpoint index {index} has no 'weight_map' of key -> file name "
                    f"(found {type(weight_map).__name__})"
                )
            files = sorted(set(weight_map.values()))
        paths = []
        for name in files:
            path = self._inside_checkpoint_dir(name)
            if path.suffix not in _WEIGHT_SUFFIXES:
                raise ValueError(f"Unknown checkpoint file format (not {_WEIGHT_SUFFIXES}): {path}")
            if not path.is_file():
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            paths.append(path)
        return sorted(paths)

    def _inside_checkpoint_dir(self, name) -> Path:
        """``checkpoint_dir / name``, refusing a name that leads outside it. Judged on the name
        (``..`` as a path component, an absolute path), not on resolved links: the snapshot
        files of Hugging Face's cache are links to blobs elsewhere."""
        if os.path.isabs(name) or ".." in Path(os.path.normpath(name)).parts:
            raise ValueError(f"Checkpoint file {name!r} is outside {self._checkpoint_dir}")
        return self._checkpoint_dir / name

    def _resume_path(self, name: Optional[str], default: str, required: bool) -> Optional[Path]:
        if name is None and not required:  # the adapter of the newest epoch, if there is one
            epochs = [p for p in self._output_dir.glob("epoch_*") if p.name[6:].isdigit()]
            if not epochs:
                return None
            path = max(epochs, key=lambda p: int(p.name[6:])) / default
            return path if path.is_file() else None
        path = self._output_dir / (name or default)
        if not path.is_file():
            raise FileNotFoundError(f"Checkpoint to resume from not found: {path}")
        return path

    def load_checkpoint(self) -> Dict[str, Any]:
        """Load the HF checkpoint (and, when resuming, the adapter and the recipe state).

        Returns:
            Dict[str, Any]: ``{"model": squash state dict}``; when resuming, also ``"adapter"``
            and the recipe-state entries (optimizer, seed, epochs run, ...).

        Raises:
            ValueError: if a file cannot be read, declares another dtype than ``config.json``,
                holds something other than tensors, repeats a
                key of another file, or the checkpoint does not match ``config.json`` (missing,
                unexpected or wrongly shaped keys, all named).
        """
        merged: Dict[str, torch.Tensor] = {}
        for path in self._checkpoint_paths:
            check_safetensors_dtypes(path.parent, [path.name])  # F16 read as BF16 is garbage
            state_dict = _load_tensors(path)
            repeated = sorted(state_dict.keys() & merged.keys())
            if repeated:
                raise ValueError(f"{path} repeats keys loaded from another file: {repeated}")
            merged.update(state_dict)
        self._validate(merged)
        result: Dict[str, Any] = {MODEL_KEY: opt_hf_to_tune(merged)}
        if self._resume:
            if self._adapter_path is not None:
                result[ADAPTER_KEY] = _load_tensors(self._adapter_path)
            result.update(_torch_load(self._recipe_path))
        return result

    def _validate(self, state_dict: Dict[str, torch.Tensor]) -> None:
        shapes = {
            (k[len(HF_PREFIX) :] if k.startswith(HF_PREFIX) else k): tuple(v.shape)
            for k, v in state_dict.items()
        }
        expected = dict(self._expected_shapes)
        if "lm_head.weight" in shapes:  # tied, but some checkpoints store a copy
            expected["lm_head.weight"] = expected["decoder.embed_tokens.weight"]
        missing = sorted(expected.keys() - shapes.keys())
        unexpected = sorted(shapes.keys() - expected.keys())
        wrong = {
            k: f"{shapes[k]} in checkpoint, {expected[k]} from config.json"
            for k in sorted(expected.keys() & shapes.keys())
            if shapes[k] != expected[k]
        }
        if missing or unexpected or wrong:
            raise ValueError(
                f"The checkpoint in {self._checkpoint_dir} does not match its config.json: "
                f"missing keys {missing}, unexpected keys {unexpected}, wrong shapes {wrong}"
            )

    def save_checkpoint(
        self,
        state_dict: Dict[str, Any],
        epoch: int,
        intermediate_checkpoint: bool = False,
        adapter_only: bool = False,
    ) -> None:
        """Write ``output_dir/epoch_{epoch}`` (and ``recipe_state`` for intermediate checkpoints).

        ``"adapter"`` holds, for each adapted linear (``layers.N.attn.q_proj``, ...), its two
        factors with squash's keys, each either dense (``...lora_a.weight``) or FFI
        (``...lora_a.values`` and ``...lora_a.indices``), as ``get_adapter_state_dict`` or
        :func:`~squash.modules.adapter_state_dict` return them for a squash or LoRA model. It is
        written unchanged to ``adapter_model.pt`` (squash's format, for resuming), and dense to
        PEFT's ``adapter_model.safetensors``: each FFI factor is checked and scattered to its
        dense ``(rows, width)`` matrix, the width of ``lora_a`` being the layer's input width
        from ``config.json`` and that of ``lora_b`` the rank (the rows of ``lora_a``). A dense
        adapter (all ``.weight``) goes to both files as it is.

        Args:
            state_dict (Dict[str, Any]): ``"model"`` (squash keys, adapters merged), optionally
                ``"adapter"`` (see above) and ``"adapter_config"`` (``r``, ``lora_alpha``,
                ``target_modules``), plus recipe state. Not modified.
            epoch (int): epoch number, used in the directory name.
            intermediate_checkpoint (bool): also write the recipe state (everything but model and
                adapter) to ``output_dir/recipe_state/recipe_state.pt``. Default False.
            adapter_only (bool): write the adapter files but not the model. Default False.

        Raises:
            ValueError: if ``adapter_only`` and there is no adapter, if ``"model"`` is missing
                otherwise, if a key cannot be converted to HF/PEFT names or an FFI factor breaks
                the format, or if ``output_dir/epoch_{epoch}`` is or contains the
                ``checkpoint_dir`` being read (saving would replace it).
        """
        if adapter_only and ADAPTER_KEY not in state_dict:
            raise ValueError("adapter_only=True but the state dict has no 'adapter' entry")
        if not adapter_only and MODEL_KEY not in state_dict:
            raise ValueError("The state dict has no 'model' entry to save")
        if not adapter_only and "tok_embeddings.weight" not in state_dict[MODEL_KEY]:
            raise ValueError(
                f"The state dict's 'model' entry ({len(state_dict[MODEL_KEY])} keys) has no "
                "'tok_embeddings.weight': pass the whole model's state dict (squash OPT keys)"
            )
        final = self._output_dir / f"epoch_{epoch}"
        ckpt, target = self._checkpoint_dir.resolve(), final.resolve()
        if target == ckpt or target in ckpt.parents:
            raise ValueError(
                f"Saving epoch {epoch} would replace {target}, which holds the checkpoint being "
                f"read ({ckpt}); give an output_dir that does not contain checkpoint_dir's epoch"
            )
        clean_stale_temporaries(self._output_dir)
        with atomic_directory(final) as tmp:
            if not adapter_only:
                self._write_model(opt_tune_to_hf(state_dict[MODEL_KEY]), tmp)
            if ADAPTER_KEY in state_dict:
                adapter = state_dict[ADAPTER_KEY]
                dense = dense_adapter(adapter, opt_adapter_layout(adapter, self._config))
                peft = opt_tune_to_peft_adapter_weights(dense)
                torch.save(adapter, tmp / "adapter_model.pt")
                save_file(_contiguous(peft), tmp / "adapter_model.safetensors", {"format": "pt"})
            if ADAPTER_CONFIG_KEY in state_dict:
                config = opt_tune_to_peft_adapter_config(
                    dict(state_dict[ADAPTER_CONFIG_KEY]),
                    base_model_name_or_path=str(self._checkpoint_dir.resolve()),
                )
                (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
            for src in self._checkpoint_dir.iterdir():
                if src.is_file() and not _NOT_COPIED.match(src.name):
                    shutil.copy2(src, tmp / src.name)
            if not adapter_only:
                _set_config_dtype(tmp / "config.json", state_dict[MODEL_KEY])
        log.info("Saved checkpoint to %s", final)

        if intermediate_checkpoint:
            recipe_state = {
                k: v
                for k, v in state_dict.items()
                if k not in (MODEL_KEY, ADAPTER_KEY, ADAPTER_CONFIG_KEY)
            }
            with atomic_directory(self._output_dir / RECIPE_STATE_DIRNAME) as tmp:
                torch.save(recipe_state, tmp / "recipe_state.pt")
            log.info("Saved recipe state to %s", self._output_dir / RECIPE_STATE_DIRNAME)

    def _write_model(self, hf_state_dict: Dict[str, torch.Tensor], out_dir: Path) -> None:
        shards: List[Dict[str, torch.Tensor]] = [{}]
        shard_bytes, total = 0, 0
        for key, tensor in hf_state_dict.items():
            size = tensor.numel() * tensor.element_size()
            if shards[-1] and shard_bytes + size > self._max_shard_size:
                shards.append({})
                shard_bytes = 0
            shards[-1][key] = tensor
            shard_bytes += size
            total += size
        if len(shards) == 1:
            save_file(_contiguous(shards[0]), out_dir / "model.safetensors", {"format": "pt"})
            return
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(_contiguous(shard), out_dir / name, {"format": "pt"})
            weight_map.update({key: name for key in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _set_config_dtype(config_path: Path, state_dict: Dict[str, torch.Tensor]) -> None:
    """Record the dtype of the written weights in the copied config.json, as transformers does."""
    dtype = str(state_dict["tok_embeddings.weight"].dtype).removeprefix("torch.")
    config = json.loads(config_path.read_text())
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    if all(config.get(k) == dtype for k in keys):
        return
    config.update({k: dtype for k in keys})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _contiguous(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # safetensors refuses non-contiguous tensors.
    return {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}


def _torch_load(path: Path) -> Dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"Cannot load {path} with torch.load(weights_only=True): {e}") from e


def _load_tensors(path: Path) -> Dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            state_dict = load_file(path)
        except Exception as e:
            raise ValueError(f"Cannot read safetensors file {path}: {e}") from e
    else:
        state_dict = _torch_load(path)
    if not isinstance(state_dict, dict):
        raise ValueError(f"{path} does not hold a state dict (found {type(state_dict).__name__})")
    not_tensors = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"{path} holds non-tensor values under {not_tensors}")
    return state_dict


def _read_json(path: Path, what: str) -> Dict[str, Any]:
    """Parse a JSON object from ``path``; errors name the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"Cannot read {path} as {what} (JSON): {e}") from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} is not {what}: a JSON object expected, found {type(data).__name__}"
        )
    return data
