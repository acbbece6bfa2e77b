"""squash.nf4.sharding: which NF4 weights torchao can split into FSDP2 row shards (the recipe
tests shard on 2 processes)."""

import torch

from squash.nf4 import to_nf4
from squash.nf4.sharding import nf4_shardable


def test_nf4_shardable_follows_torchaos_split_rule():
    """torchao splits an NF4 tensor into equal parts of its quantization blocks (64 x 256
    values per quantization factor by default), so each shard needs whole ones."""
    small = to_nf4(torch.randn(128, 128))  # 16384 values: one quantization factor
    assert nf4_shardable(small, 1) and not nf4_shardable(small, 2)
    wide = to_nf4(torch.randn(256, 128))  # two
    assert nf4_shardable(wide, 2) and not nf4_shardable(wide, 4)
    # what nf4_shardable promises is what torchao's split does
    parts = torch.chunk(wide, 2, dim=0)
    assert len(parts) == 2 and all(p.shape == (128, 128) for p in parts)
    torch.testing.assert_close(
        torch.cat([p.get_original_weight() for p in parts]), wide.get_original_weight()
    )
