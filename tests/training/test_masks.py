"""Prune-and-regrow at constant fan-in against a brute-force loop and hand-made cases; the
cosine drop-fraction schedule and when masks move (``MaskUpdateSchedule``) against hand-computed
values."""

import ast
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from squash.modules import FFILinear, sparse_lora_linear
from squash.sparsity import random_ffi_indices, validate_ffi
from squash.training import (
    cosine_drop_fraction,
    prune_and_regrow,
    record_dense_grads,
    update_masks,
)
from squash.training.masks import (
    MaskUpdateSchedule,
    dense_grad,
    grow_candidates,
    record_dense_grad,
    record_module_grow_candidates,
)


def brute_force(values, indices, grad, drop_fraction):
    """Row by row with Python lists: drop the smallest |v| (ties: lower column), grow the largest
    |g| among columns absent before (ties: lower column), new entries zero."""
    out, k = values.shape
    in_features = grad.shape[1]
    n = min(round(drop_fraction * k), in_features - k)
    new_idx, new_val = [], []
    for r in range(out):
        row = list(zip(indices[r].tolist(), values[r].tolist(), strict=True))
        by_mag = sorted(row, key=lambda cv: (abs(cv[1]), cv[0]))
        kept = dict(by_mag[n:])
        absent = [c for c in range(in_features) if c not in dict(row)]
        grown = sorted(absent, key=lambda c: (-abs(grad[r, c].item()), c))[:n]
        merged = sorted(list(kept.items()) + [(c, 0.0) for c in grown])
        new_idx.append([c for c, _ in merged])
        new_val.append([v for _, v in merged])
    return torch.tensor(new_idx), torch.tensor(new_val, dtype=values.dtype)


@pytest.mark.parametrize("drop_fraction", [0.0, 0.3, 0.5, 1.0])
def test_matches_brute_force(drop_fraction):
    g = torch.Generator().manual_seed(0)
    out, in_features, k = 6, 30, 10
    indices = random_ffi_indices(out, in_features, k, generator=g)
    # Rounded values and gradients create ties, which must break towards lower columns.
    values = torch.nn.Parameter(torch.randint(-3, 4, (out, k), generator=g).float())
    grad = torch.randint(-4, 5, (out, in_features), generator=g).float()
    exp_idx, exp_val = brute_force(values.detach(), indices, grad, drop_fraction)
    n = prune_and_regrow(values, indices, grad, drop_fraction)
    assert n == round(drop_fraction * k)
    assert indices.tolist() == exp_idx.tolist()
    assert values.detach().tolist() == exp_val.tolist()
    validate_ffi(values, indices, in_features)  # fan-in, sorted, unique, in range


def test_large_case_keeps_contract_and_changes_exactly_n():
    g = torch.Generator().manual_seed(1)
    out, in_features, k = 64, 500, 50
    indices = random_ffi_indices(out, in_features, k, generator=g)
    old = indices.clone()
    values = torch.nn.Parameter(torch.randn(out, k, generator=g))
    grad = torch.randn(out, in_features, generator=g)
    prune_and_regrow(values, indices, grad, 0.2)
    validate_ffi(values, indices, in_features)
    assert indices.shape == (out, k) and indices.dtype == torch.int16
    for r in range(out):
        assert len(set(old[r].tolist()) - set(indices[r].tolist())) == 10  # round(0.2 * 50)


def test_optimizer_state_moves_and_resets_by_hand():
    values = torch.nn.Parameter(torch.tensor([[0.5, -0.1, 2.0, 0.05]]))
    indices = torch.tensor([[1, 3, 5, 6]], dtype=torch.int16)
    opt = torch.optim.AdamW([values], lr=0.1, amsgrad=True)
    values.grad = torch.ones_like(values)
    opt.step()
    with torch.no_grad():
        values.copy_(torch.tensor([[0.5, -0.1, 2.0, 0.05]]))
    state = opt.state[values]
    state["exp_avg"].copy_(torch.tensor([[10.0, 20.0, 30.0, 40.0]]))
    state["exp_avg_sq"].copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    state["max_exp_avg_sq"].copy_(torch.tensor([[5.0, 6.0, 7.0, 8.0]]))
    step = state["step"].clone()
    # Column:      0    1(in) 2    3(in) 4    5(in) 6(in) 7
    grad = torch.tensor([[0.0, 9.0, 0.8, 7.0, 0.8, 0.0, 0.1, 0.8]])
    # Drop 2: |0.05| (col 6) and |-0.1| (col 3). Grow 2 among absent cols 0, 2, 4, 7: the |g| tie
    # 0.8 at 2, 4, 7 goes to the lower columns 2 and 4 (col 3 had a large gradient but was present).
    prune_and_regrow(values, indices, grad, 0.5, optimizer_state=opt.state[values])
    assert indices.tolist() == [[1, 2, 4, 5]]
    assert values.detach().tolist() == [[0.5, 0.0, 0.0, 2.0]]
    assert state["exp_avg"].tolist() == [[10.0, 0.0, 0.0, 30.0]]
    assert state["exp_avg_sq"].tolist() == [[1.0, 0.0, 0.0, 3.0]]
    assert state["max_exp_avg_sq"].tolist() == [[5.0, 0.0, 0.0, 7.0]]
    assert torch.equal(state["step"], step)
    assert opt.param_groups[0]["params"][0] is values  # updated in place


def test_deterministic_for_a_seed():
    def run(seed, grad):
        g = torch.Generator().manual_seed(3)
        indices = random_ffi_indices(8, 40, 8, generator=g)
        values = torch.nn.Parameter(torch.randn(8, 8, generator=g))
        prune_and_regrow(values, indices, grad, 0.5, in_features=40,
                         generator=torch.Generator().manual_seed(seed))  # fmt: skip
        return indices, values.detach()

    a, b, c = run(0, None), run(0, None), run(1, None)  # random growth (no gradient)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    grad = torch.randn(8, 40, generator=torch.Generator().manual_seed(4))
    d, e = run(0, grad), run(1, grad)  # gradient growth ignores the generator
    assert torch.equal(d[0], e[0]) and torch.equal(d[1], e[1])
    validate_ffi(a[1], a[0], 40)


def test_drop_is_capped_by_free_columns():
    values = torch.nn.Parameter(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    indices = torch.tensor([[0, 1, 2, 4]], dtype=torch.int16)
    grad = torch.zeros(1, 5)
    assert prune_and_regrow(values, indices, grad, 1.0) == 1  # only column 3 is free
    assert indices.tolist() == [[1, 2, 3, 4]] and values.detach().tolist() == [[2.0, 3.0, 0.0, 4.0]]


def test_update_masks_uses_recorded_dense_gradients():
    g = torch.Generator().manual_seed(5)
    m = sparse_lora_linear(64, 48, rank=6, alpha=12.0, sparsity=0.75, sparse_factor="both",
                         dtype=torch.float64, generator=g)  # fmt: skip
    with torch.no_grad():
        m.lora_b.values.copy_(torch.randn(m.lora_b.values.shape, generator=g))
    model = torch.nn.Sequential(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    x = torch.randn(5, 64, dtype=torch.float64, generator=g)
    grad_y = torch.randn(5, 48, dtype=torch.float64, generator=g)

    with pytest.raises(ValueError, match="no dense gradient"):
        update_masks(model, opt, 0.5)
    record_dense_grads(model)
    model(x).backward(grad_y)
    # Independent dense gradients of A and B: dense autograd through the dense factors.
    a = m.lora_a.to_dense().detach().requires_grad_(True)
    b = m.lora_b.to_dense().detach().requires_grad_(True)
    (m.scaling * (x @ a.T) @ b.T).backward(grad_y)
    torch.testing.assert_close(dense_grad(m.lora_a), a.grad)
    torch.testing.assert_close(dense_grad(m.lora_b), b.grad)

    opt.step()  # the AdamW state exists; moved entries keep theirs, grown ones get zeros
    expected, old_moments = {}, {}
    for name, factor, dense in (("0.lora_a", m.lora_a, a.grad), ("0.lora_b", m.lora_b, b.grad)):
        expected[name] = brute_force(factor.values.detach(), factor.indices, dense, 0.5)
        state = opt.state[factor.values]
        # Each row's moments by column, before the update: {column: (exp_avg, exp_avg_sq)}.
        old_moments[name] = [
            {
                int(c): (float(state["exp_avg"][r, j]), float(state["exp_avg_sq"][r, j]))
                for j, c in enumerate(factor.indices[r].tolist())
            }
            for r in range(factor.out_features)
        ]
    replaced = update_masks(model, opt, 0.5)
    assert replaced == {"0.lora_a": 8, "0.lora_b": 1}  # k = 16 and round(0.25 * 6) = 2
    for name, factor in (("0.lora_a", m.lora_a), ("0.lora_b", m.lora_b)):
        idx, val = expected[name]
        assert factor.indices.tolist() == idx.tolist()
        assert torch.equal(factor.values.detach(), val)
        assert dense_grad(factor) is None  # recording is switched off after the update
        # A kept column's moments moved with it to its new slot; a grown column's are zero.
        state, moved = opt.state[factor.values], 0
        for r in range(factor.out_features):
            for j, c in enumerate(factor.indices[r].tolist()):
                old = old_moments[name][r].get(int(c), (0.0, 0.0))
                assert (float(state["exp_avg"][r, j]), float(state["exp_avg_sq"][r, j])) == old
                moved += int(c) in old_moments[name][r]
        k = factor.fan_in
        assert moved == (k - replaced[name]) * factor.out_features
        assert any(old != (0.0, 0.0) for row in old_moments[name] for old in row.values())


def test_bad_arguments():
    values = torch.nn.Parameter(torch.ones(2, 3))
    indices = torch.tensor([[0, 1, 2], [1, 2, 3]], dtype=torch.int16)
    for bad in (1.5, -0.1, float("nan"), "0.5", None):
        with pytest.raises(ValueError, match="drop_fraction"):
            prune_and_regrow(values, indices, torch.zeros(2, 4), bad)
        with pytest.raises(ValueError, match="drop_fraction"):
            update_masks(torch.nn.Linear(2, 2), None, bad)  # even with nothing to update
    with pytest.raises(ValueError, match="in_features"):
        prune_and_regrow(values, indices, None, 0.5, in_features=0)
    with pytest.raises(ValueError, match="random_growth"):
        update_masks(torch.nn.Linear(2, 2), None, 0.5, random_growth="yes")
    with pytest.raises(ValueError, match="enabled"):
        record_dense_grads(torch.nn.Linear(2, 2), enabled="no")
    for kwargs, name in [(dict(step=-1), "step"), (dict(until_step=0), "until_step"),
                         (dict(drop_fraction=1.2), "drop_fraction")]:  # fmt: skip
        args = dict(step=0, drop_fraction=0.3, until_step=10) | kwargs
        with pytest.raises(ValueError, match=name):
            cosine_drop_fraction(**args)
    with pytest.raises(ValueError, match="in_features"):
        prune_and_regrow(values, indices, None, 0.5)
    with pytest.raises(ValueError, match="dense_grad shape"):
        prune_and_regrow(values, indices, torch.zeros(3, 4), 0.5)
    with pytest.raises(ValueError, match="not sorted"):
        prune_and_regrow(values, indices.flip(1), torch.zeros(2, 4), 0.5)


def test_full_drop_on_both_sparse_factors_is_refused():
    """drop_fraction=1.0 with both factors FFI would zero both, and zero factors get zero
    gradients forever: refused before anything changes. One dense factor regrows the other."""
    g = torch.Generator().manual_seed(6)
    m = sparse_lora_linear(32, 24, rank=4, alpha=8.0, sparsity=0.5, sparse_factor="both",
                         generator=g)  # fmt: skip
    with torch.no_grad():
        m.lora_b.values.copy_(torch.randn(m.lora_b.values.shape, generator=g))
    model = torch.nn.Sequential(m)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"drop_fraction=1\.0.*'0'.*never trains"):
        update_masks(model, None, 1.0, random_growth=True, generator=g)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # What the refusal prevents: both factors all zero give zero gradients to both.
    x = torch.randn(5, 32, generator=g)
    with torch.no_grad():
        m.lora_a.values.zero_()
        m.lora_b.values.zero_()
    m(x).sum().backward()
    assert not m.lora_a.values.grad.any() and not m.lora_b.values.grad.any()

    # With a dense B, replacing all of A is allowed and A gets a gradient again at once.
    m = sparse_lora_linear(32, 24, rank=4, alpha=8.0, sparsity=0.5, sparse_factor="a", generator=g)
    with torch.no_grad():
        m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=g))
    assert update_masks(torch.nn.Sequential(m), None, 1.0, random_growth=True) == {"0.lora_a": 16}
    assert not m.lora_a.values.any()
    m(x).sum().backward()
    assert m.lora_a.values.grad.abs().min() > 0


@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.3),  # cos(0) = 1: the full fraction
        (25, 0.15 * (1 + 2**-0.5)),  # cos(pi / 4) = 1 / sqrt(2)
        (50, 0.15),  # cos(pi / 2) = 0: half
        (75, 0.15 * (1 - 2**-0.5)),
        (100, 0.0),  # at until_step and after: no more updates
        (150, 0.0),
    ],
)
def test_cosine_drop_fraction_by_hand(step, expected):
    assert math.isclose(cosine_drop_fraction(step, 0.3, 100), expected, abs_tol=1e-12)


def test_sparsity_package_imports_nothing_else_of_squash():
    package = Path(__file__).resolve().parents[2] / "squash" / "sparsity"
    imported = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    squash_imports = {name for name in imported if name.split(".")[0] == "squash"}
    assert squash_imports and all(n.startswith("squash.sparsity") for n in squash_imports)


def test_grow_candidates_choose_what_the_dense_gradient_chooses_without_holding_it():
    """The candidates recorded during backward equal the dense path's choice, from an
    independently computed dense gradient g^T x; the update they drive equals the dense one."""
    import copy

    from squash.modules import FFILinear
    from squash.sparsity import ffi_to_dense
    from squash.training import prune_and_regrow, record_grow_candidates, update_masks

    torch.manual_seed(3)
    layer = FFILinear(300, 40, fan_in=30)  # scores in one block of rows
    wide = FFILinear(5000, 500, fan_in=50)  # blocks of 2**20 // 5000 = 209 rows: three blocks
    for module, tokens in ((layer, (3, 17)), (wide, (64,))):
        x = torch.randn(*tokens, module.in_features)
        g = torch.randn(*tokens, module.out_features)
        model = torch.nn.ModuleDict({"f": module})
        wanted = record_grow_candidates(model, drop_fraction=0.3)
        n = round(0.3 * module.fan_in)
        assert wanted == {"f": n}
        (module(x) * g).sum().backward()
        dense_grad = g.reshape(-1, module.out_features).T @ x.reshape(-1, module.in_features)
        assert grow_candidates(module).shape == (module.out_features, n)

        reference = copy.deepcopy(module)
        prune_and_regrow(reference.values, reference.indices, dense_grad, 0.3)
        update_masks(model, None, drop_fraction=0.3)
        assert torch.equal(module.indices, reference.indices)
        assert torch.equal(module.values, reference.values)
        assert grow_candidates(module) is None  # freed after the update
        # grown entries are exactly the columns that were absent and scored highest
        grown = ffi_to_dense(torch.ones_like(module.values), module.indices, module.in_features)
        assert int(grown.sum()) == module.out_features * module.fan_in


def test_grow_candidates_are_checked():
    from squash.modules import FFILinear
    from squash.training import prune_and_regrow

    module = FFILinear(10, 2, fan_in=3)
    with pytest.raises(ValueError, match="in_features - fan_in = 7"):
        record_module_grow_candidates(module, 8)
    present = module.indices.long()
    with pytest.raises(ValueError, match="name a present one"):
        prune_and_regrow(module.values, module.indices, None, 0.34, in_features=10,
                         grow_candidates=present[:, :1])
    with pytest.raises(ValueError, match=r"must be \(out=2, >= 1\)"):
        prune_and_regrow(module.values, module.indices, None, 0.34, in_features=10,
                         grow_candidates=torch.zeros(2, 0, dtype=torch.long))


def test_a_factor_where_nothing_moves_needs_no_gradient():
    """round(drop * k) = 0 for a narrow factor late in the cosine decay: that factor is left as
    it is, while a wider one with recorded candidates is updated."""
    from squash.modules import FFILinear
    from squash.training import record_grow_candidates, update_masks

    narrow, wide = FFILinear(30, 4, fan_in=3), FFILinear(300, 4, fan_in=30)
    model = torch.nn.ModuleDict({"narrow": narrow, "wide": wide})
    before = narrow.indices.clone()
    assert record_grow_candidates(model, 0.1) == {"narrow": 0, "wide": 3}
    x = torch.randn(5, 30)
    (narrow(x).sum() + wide(torch.randn(5, 300)).sum()).backward()
    assert grow_candidates(narrow) is None  # nothing to record
    assert update_masks(model, None, 0.1) == {"narrow": 0, "wide": 3}
    assert torch.equal(narrow.indices, before)


def test_the_mask_update_schedule_is_due_every_n_steps_before_until_step_with_a_cosine_drop():
    schedule = MaskUpdateSchedule.from_config(
        OmegaConf.create({"every_n_steps": 3, "drop_fraction": 0.4, "until_step": 10})
    )
    assert MaskUpdateSchedule.from_config(None) is None
    assert [s for s in range(1, 15) if schedule.due(s)] == [3, 6, 9]
    for step in (3, 6, 9):
        assert schedule.drop(step) == pytest.approx(0.2 * (1 + math.cos(math.pi * step / 10)))
    assert schedule.drop(10) == 0.0


def test_record_dense_grad_gives_grad_out_t_x():
    """The recorded dense gradient is ``grad_out^T @ x`` by hand, the values' gradient is the
    sparse path's, and the output is the dense product (FFILinear's own ``to_dense`` is checked
    against a loop in tests/modules)."""
    g = torch.Generator().manual_seed(6)
    m = FFILinear(10, 4, 3, dtype=torch.float64, generator=g)
    x = torch.randn(2, 5, 10, dtype=torch.float64, generator=g)
    grad_out = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    m(x).backward(grad_out)
    sparse_values_grad = m.values.grad.clone()
    m.values.grad = None
    record_dense_grad(m, True)
    y = m(x)
    torch.testing.assert_close(y, x @ m.to_dense().T)
    y.backward(grad_out)
    expected = grad_out.reshape(-1, 4).T @ x.reshape(-1, 10)  # (out, in)
    torch.testing.assert_close(dense_grad(m), expected)
    torch.testing.assert_close(m.values.grad, sparse_values_grad)
    m(x).backward(grad_out)  # accumulates, like .grad does
    torch.testing.assert_close(dense_grad(m), 2 * expected)
    record_dense_grad(m, False)
    assert dense_grad(m) is None
