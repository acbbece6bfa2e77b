"""The ``general.*`` keys of a GGUF file squash writes: what the model is, who made it, its size
and licence, and a note that squash wrote the file.

The model's own keys are read as llama.cpp's ``convert_hf_to_gguf.py`` reads them, with the
``gguf`` package's :class:`gguf.Metadata`: the front matter of the model card (``README.md``:
``name``, ``organization``, ``basename``, ``finetune``, ``license``, ``language``, ...),
``config.json``'s ``_name_or_path``, the directory's name, and the sampling settings of
``generation_config.json``. ``squash download`` writes a model card holding the upstream GGUF's
keys, so an export of the downloaded model carries them unchanged.

A fine-tune (a squash checkpoint: the base with an adapter merged in) keeps the base's keys,
names the base in ``general.base_model.0.*``, and says which checkpoint it is in its name,
``general.finetune`` and the note in ``general.description``.
"""

import dataclasses
from pathlib import Path
from typing import Tuple

import gguf
from gguf.metadata import Metadata

import squash


def model_metadata(model_dir: Path) -> Metadata:
    """The ``general.*`` metadata of the Hugging Face model directory ``model_dir``, as
    ``convert_hf_to_gguf.py`` derives it (its name falls back to the directory's)."""
    model_dir = Path(model_dir)
    meta = Metadata.load(None, model_dir, None, 0)
    if meta.name is None:
        meta.name = model_dir.name
    return meta


def finetune_metadata(base: Metadata, checkpoint: str) -> Metadata:
    """The metadata of a fine-tune of ``base``: the base's keys (licence, basename, size class,
    organization, description), the base named in ``general.base_model.0``, and the checkpoint
    in the name and ``general.finetune`` (the note :func:`add_general` adds says more).

    Args:
        base (Metadata): :func:`model_metadata` of the base model.
        checkpoint (str): how to name the checkpoint, e.g. ``"smollm2_135m/epoch_0"``.
    """
    parent = {k: v for k, v in (("name", base.name), ("organization", base.organization),
                                ("version", base.version)) if v is not None}  # fmt: skip
    return dataclasses.replace(
        base,
        name=f"{base.name} squash {checkpoint}",
        finetune=f"{base.finetune}-squash" if base.finetune else "squash",
        base_models=[parent],
    )


def add_general(
    writer: gguf.GGUFWriter, meta: Metadata, params: Tuple[int, int, int, int], source: str
) -> None:
    """Write ``meta`` as ``general.*`` keys, ``general.type`` ``"model"``, the size label of
    ``params`` (``writer.get_total_parameter_count()``) where ``meta`` has none, and a note
    that squash wrote the file (``general.description``, after the model's own description).

    Args:
        writer (gguf.GGUFWriter): the writer, its tensors already added.
        meta (Metadata): :func:`model_metadata` or :func:`finetune_metadata`.
        params (Tuple[int, int, int, int]): total, shared and expert parameters, expert count.
        source (str): what the weights were read from, for the note.
    """
    meta = dataclasses.replace(meta)
    if meta.size_label is None and params[0] > 0:
        meta.size_label = gguf.size_label(*params)
    note = f"GGUF written by squash {squash.__version__} from {source}"
    meta.description = f"{meta.description}. {note}" if meta.description else note
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
