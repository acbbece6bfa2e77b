"""SquareHeadLoss against the formula computed independently, position by position, in float64."""

import math

import pytest
import torch

from squash.losses import SquareHeadLoss


def _padded_batch(seed, b=3, s=7, dims=(16, 16, 24), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 4, 1][:b]
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    student, teacher = [], []
    for d in dims:
        scale = float(torch.rand((), generator=g) * 10 + 0.1)  # layers of very different scales
        t = torch.randn(b, s, d, generator=g) * scale
        h = t + torch.randn(b, s, d, generator=g) * scale * 0.3
        # padding holds garbage that would dominate the loss if it were counted
        h[~mask] = 1e4
        t[~mask] = -1e4
        student.append(h.to(dtype))
        teacher.append(t.to(dtype))
    return student, teacher, mask, lengths


def _by_hand(student, teacher, lengths):
    """sum_l mean((h_s - h_t)^2) / mean(h_t^2), the means over the real positions and features,
    as Python floats accumulated in float64."""
    total = 0.0
    for h_s, h_t in zip(student, teacher):
        err, sq, n = 0.0, 0.0, 0
        for i, length in enumerate(lengths):
            for t in range(length):
                for f in range(h_s.shape[-1]):
                    a, b = float(h_s[i, t, f]), float(h_t[i, t, f])
                    err += (a - b) ** 2
                    sq += b * b
                    n += 1
        total += (err / n) / (sq / n)
    return total


def test_equals_the_formula_on_random_hidden_states_with_padding():
    student, teacher, mask, lengths = _padded_batch(0)
    loss = SquareHeadLoss()(student, teacher, mask)
    assert loss.dtype == torch.float32
    expected = _by_hand(student, teacher, lengths)
    assert loss.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    # each layer counts about the same whatever its scale: every term is near 0.3^2
    assert expected == pytest.approx(3 * 0.09, rel=0.3)


def test_is_zero_when_the_student_equals_the_teacher():
    student, teacher, mask, _ = _padded_batch(1)
    same = [t.clone() for t in teacher]
    assert SquareHeadLoss()(same, teacher, mask).item() == 0.0
    assert SquareHeadLoss()(same, teacher).item() == 0.0


def test_without_a_mask_every_position_counts():
    student, teacher, _, _ = _padded_batch(2, b=2)
    loss = SquareHeadLoss()(student, teacher)
    expected = _by_hand(student, teacher, [7, 7])
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_bf16_states_accumulate_in_fp32():
    student, teacher, mask, lengths = _padded_batch(3, dtype=torch.bfloat16)
    loss = SquareHeadLoss()(student, teacher, mask)
    assert loss.dtype == torch.float32
    # the formula on the very same (bf16-rounded) numbers, in float64
    assert loss.item() == pytest.approx(_by_hand(student, teacher, lengths), rel=1e-6)


def test_a_zero_teacher_layer_gives_a_finite_loss_through_eps():
    student, teacher, mask, lengths = _padded_batch(4, dims=(8,))
    teacher = [torch.zeros_like(teacher[0])]
    loss = SquareHeadLoss(eps=1e-8)(student, teacher, mask)
    assert math.isfinite(loss.item())
    n = sum(lengths) * 8
    err = sum(float(student[0][i, :k].double().square().sum()) for i, k in enumerate(lengths))
    assert loss.item() == pytest.approx((err / n) / 1e-8, rel=1e-6)


def test_no_counted_position_gives_zero_and_gradients_only_reach_the_student():
    student, teacher, mask, _ = _padded_batch(5)
    assert SquareHeadLoss()(student, teacher, torch.zeros_like(mask)).item() == 0.0
    student = [h.clone().requires_grad_(True) for h in student]
    teacher = [t.clone().requires_grad_(True) for t in teacher]
    SquareHeadLoss()(student, teacher, mask).backward()
    assert all(t.grad is None for t in teacher)
    # d/dh_s of err/sq_t: 2 (h_s - h_t) / (n * mean(h_t^2)) at counted positions, 0 at padding
    h_s, h_t = student[0].detach(), teacher[0].detach()
    n = int(mask.sum()) * h_s.shape[-1]
    mean_t = float(h_t[mask].double().square().sum()) / n
    expected = 2 * (h_s - h_t) / (n * mean_t) * mask[..., None]
    torch.testing.assert_close(student[0].grad, expected.float(), rtol=1e-5, atol=1e-9)


def test_mismatched_inputs_are_refused():
    student, teacher, mask, _ = _padded_batch(6)
    with pytest.raises(ValueError, match="2 student hidden states but 3"):
        SquareHeadLoss()(student[:2], teacher, mask)
    with pytest.raises(ValueError, match="hidden state 2"):
        SquareHeadLoss()(student[:2] + [student[2][..., :8]], teacher, mask)
    with pytest.raises(ValueError, match="mask"):
        SquareHeadLoss()(student, teacher, mask[:, :3])
    with pytest.raises(ValueError, match="eps"):
        SquareHeadLoss(eps=0.0)
