"""The data a training recipe reads: a stateful (resumable) loader over the ``dataset`` block,
sharded over ranks for a distributed run, whose records name themselves when one cannot be used
(:class:`NamedRecordErrors`), and the optimizer steps an epoch of it makes."""

from functools import partial
from typing import Any, Mapping, Optional

from omegaconf import ListConfig
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset

from squash._io import to_plain
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
) -> StatefulDataLoader:
    """A stateful (resumable) data loader over ``cfg_dataset`` (one dataset block or a list).

    With ``num_replicas`` N, rank r takes samples r, r + N, r + 2N, ... of the seeded
    permutation: N ranks with ``batch_size`` b see, step by step, the samples one device sees
    with batch size N * b.

    Raises:
        ConfigKeyError: if the data lacks a column the dataset needs, naming the columns it has.
    """
    try:
        if isinstance(cfg_dataset, ListConfig):
            ds = ConcatDataset([config.instantiate(c, tokenizer) for c in cfg_dataset])
            packed = getattr(ds, "packed", False)
        else:
            ds = config.instantiate(cfg_dataset, tokenizer)
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
