"""The data a training recipe reads: a stateful (resumable) loader over the ``dataset`` block,
sharded over ranks for a distributed run, whose records name themselves when one cannot be used
(:class:`NamedRecordErrors`), and the optimizer steps an epoch of it makes.

Local data files are read by content (:func:`instantiate_dataset`): the HF ``datasets`` cache
knows a local file by its path and modification time, so a file edited in place keeping both
(``cp -p``, ``rsync -t``, ``touch -r``, an edit within the timestamp resolution) would be read
from the cache as it was. Each dataset block gets a cache directory of its own content."""

import hashlib
import inspect
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import ListConfig
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset

from squash._io import file_sha256, to_plain
from squash.config.keys import ConfigKeyError


def setup_dataloader(
    cfg_dataset: Any,
    tokenizer: Any,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    collate_fn: Optional[str] = None,
    ignore_index: int = -100,
    drop_last: bool = True,
    num_replicas: int = 1,
    rank: int = 0,
    recorded: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> StatefulDataLoader:
    """A stateful (resumable) data loader over ``cfg_dataset`` (one dataset block or a list).

    With ``num_replicas`` N, rank r takes samples r, r + N, r + 2N, ... of the seeded
    permutation: N ranks with ``batch_size`` b see, step by step, the samples one device sees
    with batch size N * b. ``recorded``: the run's record of its input files
    (:func:`squash.runs.run_lock.input_record`), whose sha256 the data read must have
    (:func:`instantiate_dataset`).

    Raises:
        ConfigKeyError: if the data lacks a column the dataset needs, naming the columns it has;
            a local data file whose content is not the one the run recorded.
    """
    try:
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset([instantiate_dataset(c, tokenizer, recorded) for c in cfg_dataset])
            packed = getattr(ds, "packed", False)
        else:
            ds = instantiate_dataset(cfg_dataset, tokenizer, recorded)
            packed = cfg_dataset.get("packed", False)
        ds = NamedRecordErrors(ds, dataset_where(cfg_dataset))
        ds[0]  # a missing column shows here, not deep inside the first step
    except KeyError as e:
        columns = dataset_columns(cfg_dataset)
        raise ConfigKeyError(
            f"dataset: the data has no column {e}; its columns are {columns}. "
            "Map yours with dataset.column_map (e.g. column_map: {input: my_input})"
        ) from e
    check_tokens_to_train(ds, tokenizer, ignore_index, dataset_where(cfg_dataset))
    collate = _get_component_from_path(collate_fn or "torchtune.data.padded_collate_sft")
    if not packed:
        collate = partial(collate, padding_idx=tokenizer.pad_id, ignore_idx=ignore_index)
    sampler = StatefulDistributedSampler(
        ds, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
    )
    return StatefulDataLoader(
        dataset=ds,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate if not packed else padded_collate_packed,
        drop_last=drop_last,
    )


def local_data_files(node: Any) -> List[Path]:
    """The local files a dataset block reads, resolved and sorted: its ``data_files`` that exist
    here, every file under its ``data_dir`` and under (or at) a ``source`` that is a local path.
    Remote data (a Hub name, a URL) is not among them: the ``datasets`` cache keys it itself."""
    if not isinstance(node, Mapping):
        return []
    paths = [Path(v) for v in _strings(node.get("data_files"))]
    paths += [Path(v) for k in ("data_dir", "source") for v in _strings(node.get(k))]
    files = set()
    for path in (p.expanduser() for p in paths):
        if path.is_file():
            files.add(path.resolve())
        elif path.is_dir():
            files.update(f.resolve() for f in path.rglob("*") if f.is_file())
    return sorted(files)


def _strings(value: Any) -> List[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple, ListConfig)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    return []


def content_cache_dir(files: List[Path], shas: List[str], root: Optional[str] = None) -> Path:
    """The ``datasets`` cache directory of data whose local files ``files`` hold ``shas``: under
    ``root`` (the block's own ``cache_dir``, else the ``datasets`` default), one directory per
    content, so an edit that keeps a file's path, size and mtime still reads the new bytes."""
    if root is None:
        import datasets

        root = datasets.config.HF_DATASETS_CACHE
    key = hashlib.sha256("\n".join(f"{f}:{s}" for f, s in zip(files, shas)).encode()).hexdigest()
    return Path(root).expanduser() / "squash-by-content" / key[:32]


def _accepts_cache_dir(node: Mapping) -> bool:
    """Whether the block's builder takes ``cache_dir`` (torchtune's pass ``**load_dataset_kwargs``
    to ``datasets.load_dataset``)."""
    try:
        builder = _get_component_from_path(node["_component_"])
        params = inspect.signature(builder).parameters.values()
    except Exception:  # not introspectable: instantiate it as it is
        return False
    return any(p.name == "cache_dir" or p.kind is p.VAR_KEYWORD for p in params)


def instantiate_dataset(
    node: Any, tokenizer: Any, recorded: Optional[Mapping[str, Mapping[str, Any]]] = None
) -> Any:
    """``config.instantiate(node, tokenizer)``, reading the block's local data files by content:
    its builder is given a ``cache_dir`` keyed by their sha256 (:func:`content_cache_dir`), the
    one the run recorded for a file in ``recorded`` (:func:`squash.runs.run_lock.input_record`),
    else hashed here. After loading, each file is hashed again: a file changed meanwhile (so the
    cache may hold other bytes than its key says) is refused, and that cache removed.

    Raises:
        ConfigKeyError: a local data file changed since the run hashed it, naming it.
    """
    files = local_data_files(node)
    if not files or "_component_" not in node or not _accepts_cache_dir(node):
        return config.instantiate(node, tokenizer)
    by_path: Dict[str, str] = {
        str(r["path"]): str(r["sha256"]) for r in (recorded or {}).values()
        if isinstance(r, Mapping) and "path" in r and "sha256" in r
    }
    shas = [by_path.get(str(f)) or file_sha256(f) for f in files]
    cache = content_cache_dir(files, shas, node.get("cache_dir"))
    ds = config.instantiate(node, tokenizer, cache_dir=str(cache))
    for f, sha in zip(files, shas):
        now = file_sha256(f)
        if now != sha:
            shutil.rmtree(cache, ignore_errors=True)
            raise ConfigKeyError(
                f"{dataset_where(node)}: {f} changed while the run read it (sha256 "
                f"{now[:12]}..., recorded {sha[:12]}...); start the run again once the "
                "file is as it should be"
            )
    return ds


def check_tokens_to_train(ds: Any, tokenizer: Any, ignore_index: int, where: str, n: int = 8) -> None:
    """Refuse data whose first ``n`` records have no label to train on: every loss would be
    0 / 0, and the run would stop at its first step with a NaN loss naming no key. The usual
    cause is a ``tokenizer.max_seq_len`` no longer than the prompt template, which truncation
    then leaves as the whole sample (its labels masked).

    Raises:
        ConfigKeyError: naming ``tokenizer.max_seq_len`` (or, without one, the dataset).
    """
    count = min(len(ds), n)
    if count == 0:
        return
    for i in range(count):
        sample = ds[i]
        labels = sample.get("labels") if isinstance(sample, dict) else None
        # the recipes predict token t+1 at position t: the first label is never trained on
        if labels is None or any(int(label) != ignore_index for label in list(labels)[1:]):
            return
    max_len = getattr(tokenizer, "max_seq_len", None)
    if max_len is not None:
        raise ConfigKeyError(
            f"tokenizer.max_seq_len={max_len} leaves no token to train on in the first {count} "
            f"records of {where}: the prompt template alone fills it; raise tokenizer.max_seq_len"
        )
    raise ConfigKeyError(f"{where}: the first {count} records have no token to train on "
                         "(every label is masked)")


def dataset_columns(cfg_dataset: Any) -> Any:
    """Column names of a dataset config's data, for an error message (best effort)."""
    try:
        from datasets import load_dataset

        node = cfg_dataset[0] if isinstance(cfg_dataset, ListConfig) else cfg_dataset
        kwargs = {k: v for k, v in node.items() if k in ("data_files", "name", "split")}
        return load_dataset(node.source, **kwargs).column_names
    except Exception:  # the message is still useful without them
        return "unknown"


def steps_per_epoch(
    num_batches: int,
    *,
    batch_size: int,
    grad_accum: int,
    max_steps_per_epoch: Optional[int],
    per_rank: bool = False,
) -> int:
    """Optimizer steps an epoch of ``num_batches`` batches makes, at most ``max_steps_per_epoch``.

    Raises:
        ConfigKeyError: if the batches make no optimizer step.
    """
    steps = num_batches // grad_accum
    if steps == 0:
        raise ConfigKeyError(
            f"dataset: {num_batches} batches of batch_size={batch_size}"
            f"{' per rank' if per_rank else ''} make no optimizer step with "
            f"gradient_accumulation_steps={grad_accum}"
        )
    return steps if max_steps_per_epoch is None else min(steps, max_steps_per_epoch)


class NamedRecordErrors:
    """A map-style dataset whose records, when one cannot be turned into a sample (a null
    ``output``, a value of the wrong type), raise a ``ValueError`` naming the record, the data
    files and the record's null fields, instead of the transform's own error (torchtune's
    ``AssertionError: content must be of type List[Dict[str, Any]], got None``).

    A ``KeyError`` (a missing column) passes through unchanged: the recipe names the columns
    there are. Every other attribute is the wrapped dataset's.

    Args:
        dataset (Any): the dataset (``len`` and ``[]``).
        where (str): the config key and data files, for the message.
    """

    def __init__(self, dataset: Any, where: str) -> None:
        self._dataset, self._where = dataset, where

    def __len__(self) -> int:
        return len(self._dataset)

    def __getattr__(self, name: str) -> Any:
        if "_dataset" not in self.__dict__:  # during unpickling
            raise AttributeError(name)
        return getattr(self.__dict__["_dataset"], name)

    def __getitem__(self, index: int) -> Any:
        try:
            return self._dataset[index]
        except KeyError:
            raise
        except Exception as e:
            raise ValueError(
                f"{self._where}: record {index} cannot be used{self._nulls(index)} "
                f"({type(e).__name__}: {e})"
            ) from e

    def _nulls(self, index: int) -> str:
        try:
            raw = self._dataset._data[index]
            nulls = [k for k, v in raw.items() if v is None]
        except Exception:  # not an HF-backed dataset: the message is useful without it
            return ""
        return f": it has null {nulls}" if nulls else ""


def dataset_where(cfg_dataset: Any) -> str:
    """``dataset (data_files ...)``: how messages name a dataset block."""
    nodes = cfg_dataset if isinstance(cfg_dataset, (list, ListConfig)) else [cfg_dataset]
    files = [n.get("data_files") or n.get("source") for n in nodes if isinstance(n, Mapping)]
    files = [to_plain(f) for f in files]
    return f"dataset ({files[0] if len(files) == 1 else files})"
