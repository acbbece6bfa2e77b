"""Logit distillation: the KL divergence from the teacher's next-token distribution to the
student's, on the positions whose label counts."""

from typing import List, Union

import torch
from torch import nn
from torchtune.modules.loss import ForwardKLLoss


class LogitKLLoss(nn.Module):
    """``KL(p_t || p_s)`` per token, averaged over the tokens whose label is not ``ignore_index``.

    torchtune's :class:`~torchtune.modules.loss.ForwardKLLoss` computes the cross-entropy
    ``-sum_v p_t(v) log p_s(v)``, which has the KL's gradient but is not 0 when the student
    matches the teacher (it is the teacher's entropy then). This loss reuses it for both terms,
    ``KL = H(p_t, p_s) - H(p_t, p_t)``, so that the logged value is a true divergence (0 at a
    perfect student) and the gradient is torchtune's. It takes whole logits ``(b, s, v)`` or the
    chunks that a model returns when ``set_num_output_chunks`` is on (the chunked cross-entropy
    loss's format), and upcasts one chunk at a time to float32 as
    :class:`~torchtune.modules.loss.ForwardKLWithChunkedOutputLoss` does.

    Args:
        temperature (float): both distributions are ``softmax(logits / temperature)``; the loss
            is multiplied by ``temperature ** 2`` so its gradient scale does not depend on it
            (Hinton et al., 2015). Default: 1.0
        ignore_index (int): label value of positions that do not count. Default: -100
    """

    def __init__(self, temperature: float = 1.0, ignore_index: int = -100) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.ignore_index = ignore_index
        self._fkl = ForwardKLLoss(ignore_index=ignore_index)

    def forward(
        self,
        student_logits: Union[torch.Tensor, List[torch.Tensor]],
        teacher_logits: Union[torch.Tensor, List[torch.Tensor]],
        labels: torch.Tensor,
    ) -> torch.Tensor:
        """
        Args:
            student_logits (Union[torch.Tensor, List[torch.Tensor]]): ``(b, s, v)``, or a list
                of chunks ``(b, s_i, v)`` along the sequence.
            teacher_logits (Union[torch.Tensor, List[torch.Tensor]]): the same layout.
            labels (torch.Tensor): ``(b, s)``, already shifted so that position ``t`` holds
                the label predicted there.

        Returns:
            torch.Tensor: float32 scalar, 0 when no label counts.
        """
        if isinstance(student_logits, torch.Tensor):
            student_logits, teacher_logits = [student_logits], [teacher_logits]
        if len(student_logits) != len(teacher_logits):
            raise ValueError(
                f"{len(student_logits)} student logit chunks but {len(teacher_logits)} teacher ones"
            )
        label_chunks = labels.split([c.shape[1] for c in student_logits], dim=1)
        total = torch.zeros((), dtype=torch.float32, device=labels.device)
        for s, t, y in zip(student_logits, teacher_logits, label_chunks):
            s = s.reshape(-1, s.shape[-1]).float() / self.temperature
            t = t.detach().reshape(-1, t.shape[-1]).float() / self.temperature
            y = y.reshape(-1)
            total = total + self._fkl(s, t, y, normalize=False) - self._fkl(t, t, y, normalize=False)
        count = (labels != self.ignore_index).sum()
        return total * self.temperature**2 / count.clamp_min(1)
