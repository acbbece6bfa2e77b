"""SquareHead: per-layer feature distillation normalized by the teacher's own magnitude.

Kurtic et al., "Sparse Fine-tuning for Inference Acceleration of Large Language Models" (2023):
for each chosen decoder layer ``l``,

    L_l = MSE(h_s^l, h_t^l) / MSE(h_t^l, 0)

where both means run over every position that counts (not padding) and every feature of that
layer's hidden state; the loss is the sum of ``L_l`` over the chosen layers. Dividing by the
teacher's mean square makes every layer count about the same, whatever its scale (hidden states
of late layers are often much larger than those of early ones).
"""

from typing import Optional, Sequence

import torch
from torch import nn


class SquareHeadLoss(nn.Module):
    """SquareHead distillation loss over a list of hidden states.

    Hidden states come from torchtune's :class:`~torchtune.modules.TransformerDecoder` with
    ``output_hidden_states`` set (squash's ``OPTDecoder`` included): the model then returns the
    inputs of the listed layers followed by the logits, so no forward hooks are needed and
    ``torch.compile`` traces the model unchanged.

    Everything is accumulated in float32 whatever the dtype of the hidden states. The sum of
    squares of the teacher is clamped below by ``eps`` (per layer) so that a layer whose teacher
    state is (near) zero gives a large but finite loss instead of inf/NaN; with the default
    ``1e-8`` the clamp never acts on a real model's hidden states, whose mean square is many
    orders of magnitude larger.

    Args:
        eps (float): lower bound on each layer's teacher mean square ``MSE(h_t, 0)``.
            Default: 1e-8

    Example:
        >>> loss_fn = SquareHeadLoss()
        >>> student.output_hidden_states = teacher.output_hidden_states = [1, 2]
        >>> *h_s, logits = student(tokens)
        >>> *h_t, _ = teacher(tokens)
        >>> loss = loss_fn(h_s, h_t, mask=tokens != pad_id)
    """

    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.eps = eps

    def forward(
        self,
        student_hidden: Sequence[torch.Tensor],
        teacher_hidden: Sequence[torch.Tensor],
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """
        Args:
            student_hidden (Sequence[torch.Tensor]): one hidden state per chosen layer, each
                ``(b, s, d)`` (``d`` may differ from layer to layer).
            teacher_hidden (Sequence[torch.Tensor]): the teacher's, same shapes; no gradient
                flows into them.
            mask (Optional[torch.Tensor]): boolean ``(b, s)``, True at positions that count
                (False at padding). Default None: every position counts.

        Returns:
            torch.Tensor: the summed loss, a float32 scalar; 0 when no position counts.

        Raises:
            ValueError: if the two lists differ in length, or two paired states or the mask
                differ in shape.
        """
        if len(student_hidden) != len(teacher_hidden):
            raise ValueError(
                f"{len(student_hidden)} student hidden states but {len(teacher_hidden)} teacher ones"
            )
        total = torch.zeros((), dtype=torch.float32, device=_device(student_hidden, mask))
        for layer, (h_s, h_t) in enumerate(zip(student_hidden, teacher_hidden)):
            if h_s.shape != h_t.shape:
                raise ValueError(
                    f"hidden state {layer}: student {tuple(h_s.shape)}, teacher {tuple(h_t.shape)}"
                )
            if mask is not None and tuple(mask.shape) != tuple(h_s.shape[:-1]):
                raise ValueError(
                    f"mask {tuple(mask.shape)} does not match hidden state {tuple(h_s.shape)}"
                )
            h_t = h_t.detach().float()
            sq_err = (h_s.float() - h_t).square().sum(-1)  # (b, s)
            sq_t = h_t.square().sum(-1)  # (b, s)
            if mask is None:
                count = torch.tensor(float(sq_err.numel()), device=total.device)
            else:
                keep = mask.to(torch.float32)
                sq_err, sq_t, count = sq_err * keep, sq_t * keep, keep.sum()
            n = count.clamp_min(1.0) * h_t.shape[-1]  # positions x features
            mse_st = sq_err.sum() / n
            mse_t0 = (sq_t.sum() / n).clamp_min(self.eps)
            total = total + mse_st / mse_t0
        return total


def _device(hidden: Sequence[torch.Tensor], mask: Optional[torch.Tensor]) -> torch.device:
    if len(hidden):
        return hidden[0].device
    return mask.device if mask is not None else torch.device("cpu")
