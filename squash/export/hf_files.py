"""Reading a Hugging Face model directory (``config.json`` and ``model*.safetensors``): what
:mod:`squash.merge` and :mod:`squash.export.gguf` both need, without the ``gguf`` package."""

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from safetensors import safe_open

__all__ = ["GGUF_DTYPES", "load_merged_checkpoint", "read_json", "weight_files"]

GGUF_DTYPES = ("f16", "q8_0")  # what squash writes GGUF files in


def read_json(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise FileNotFoundError(f"Cannot read {path}: {e}") from e
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def weight_files(checkpoint_dir: Path) -> List[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [checkpoint_dir / n for n in names]
        for f in files:
            if f.parent != checkpoint_dir or not f.is_file():
                raise FileNotFoundError(f"{index} names {f.name}, which is not in {checkpoint_dir}")
        return files
    files = sorted(checkpoint_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No weights (model*.safetensors) in {checkpoint_dir}: not a Hugging Face model "
            "directory (a squash checkpoint saved with save_adapter_weights_only is exported by "
            "squash.merge.export_checkpoint, `squash export`)"
        )
    return files


def load_merged_checkpoint(
    checkpoint_dir: Path, float32: bool = True
) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """``config.json`` and the merged weights (float32, or with ``float32=False`` as stored; on
    the CPU) of a Hugging Face checkpoint directory (an ``epoch_N``/``step_N`` of a squash run,
    or any HF model directory).

    Raises:
        FileNotFoundError: if the directory, its ``config.json`` or its weights are missing.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {checkpoint_dir} does not exist")
    config = read_json(checkpoint_dir / "config.json")
    weights = {}
    for f in weight_files(checkpoint_dir):
        with safe_open(f, framework="pt") as handle:
            for key in handle.keys():
                if key in weights:
                    raise ValueError(f"{f} repeats the tensor {key}")
                tensor = handle.get_tensor(key)
                weights[key] = tensor.float() if float32 else tensor
    return config, weights
