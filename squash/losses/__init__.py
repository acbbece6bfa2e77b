"""Distillation losses: SquareHead (per-layer normalized feature loss) and logit KL."""

from squash.losses.kd import LogitKLLoss
from squash.losses.squarehead import SquareHeadLoss

__all__ = ["LogitKLLoss", "SquareHeadLoss"]
