"""Pieces of squash.training.distributed that need no process group (the recipe tests run the
rest on 2 processes)."""

import torch


def test_a_sharded_mask_update_skips_a_factor_where_nothing_moves_without_its_gradient(tmp_path):
    """round(drop * k) = 0 in ``still`` (k = 2): it needs no gradient and keeps its mask, while
    ``moved`` (k = 6, one entry a row) moves exactly as update_masks moves it on one device."""
    import copy

    import torch.distributed as dist
    from torch import nn

    from squash.modules import sparse_lora_linear
    from squash.training import update_masks
    from squash.training.distributed import update_masks_sharded
    from squash.training.masks import (
        dense_grad,
        entries_replaced,
        record_dense_grad,
        record_dense_grads,
    )

    torch.manual_seed(0)
    model = nn.ModuleDict({
        name: sparse_lora_linear(64, 32, rank=8, alpha=16, sparsity=sparsity, sparse_factor="a")
        for name, sparsity in (("still", 0.97), ("moved", 0.9))
    })  # fmt: skip
    still, moved = model["still"].lora_a, model["moved"].lora_a
    assert (still.fan_in, moved.fan_in) == (2, 6)
    assert entries_replaced(0.2, 2, 64) == 0 and entries_replaced(0.2, 6, 64) == 1
    for adapter in model.values():
        with torch.no_grad():
            adapter.lora_b.weight.normal_()
    record_dense_grads(model, True)
    x = torch.randn(5, 64)
    (model["still"](x) + model["moved"](x)).square().sum().backward()
    record_dense_grad(still, False)  # still's gradient is gone
    reference = copy.deepcopy(model)
    expected = update_masks(reference, None, 0.2, {"moved.lora_a": dense_grad(moved).clone()})
    before, moved_before = still.indices.clone(), moved.indices.clone()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        replaced = update_masks_sharded(model, None, 0.2, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert replaced == expected == {"still.lora_a": 0, "moved.lora_a": 1}
    assert torch.equal(still.indices, before)
    assert not torch.equal(moved.indices, moved_before)
    assert torch.equal(moved.indices, reference["moved"].lora_a.indices)
    assert torch.equal(moved.values, reference["moved"].lora_a.values)
    assert dense_grad(moved) is None  # recording switched off
