"""LogitKLLoss against torch's own KL divergence and a float64 computation."""

import pytest
import torch
import torch.nn.functional as F

from squash.losses import LogitKLLoss


def _logits(seed, b=2, s=6, v=11):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(b, s, v, generator=g) * 3
    teacher = torch.randn(b, s, v, generator=g) * 3
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, 4:] = -100  # padding
    labels[1, :2] = -100  # a prompt that does not count
    return student, teacher, labels


def _kl_float64(student, teacher, labels, temperature=1.0):
    keep = labels != -100
    log_p_s = F.log_softmax(student.double() / temperature, -1)[keep]
    log_p_t = F.log_softmax(teacher.double() / temperature, -1)[keep]
    per_token = F.kl_div(log_p_s, log_p_t, reduction="none", log_target=True).sum(-1)
    return per_token.mean().item() * temperature**2


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_equals_kl_over_counted_tokens(temperature):
    student, teacher, labels = _logits(0)
    loss = LogitKLLoss(temperature=temperature)(student, teacher, labels)
    assert loss.item() == pytest.approx(_kl_float64(student, teacher, labels, temperature), rel=1e-5)


def test_chunked_logits_give_the_same_value():
    student, teacher, labels = _logits(1)
    whole = LogitKLLoss()(student, teacher, labels)
    chunked = LogitKLLoss()(list(student.chunk(3, dim=1)), list(teacher.chunk(3, dim=1)), labels)
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    assert whole.item() == pytest.approx(_kl_float64(student, teacher, labels), rel=1e-5)


def test_zero_when_the_student_equals_the_teacher_and_gradients_reach_the_student_only():
    student, teacher, labels = _logits(2)
    assert abs(LogitKLLoss()(teacher.clone(), teacher, labels).item()) < 1e-6
    s = student.clone().requires_grad_(True)
    t = teacher.clone().requires_grad_(True)
    LogitKLLoss()(s, t, labels).backward()
    assert t.grad is None
    # d KL / d s = (p_s - p_t) / count at counted positions
    keep = (labels != -100)[..., None]
    expected = (F.softmax(student, -1) - F.softmax(teacher, -1)) * keep / keep.sum()
    torch.testing.assert_close(s.grad, expected, rtol=1e-5, atol=1e-7)
