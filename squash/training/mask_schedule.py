"""When the masks move and by how much: the ``mask_update`` block of a recipe config."""

from dataclasses import dataclass
from typing import Any, Optional

from squash.training.config_checks import parse_mask_update
from squash.training.mask_update import cosine_drop_fraction


@dataclass(frozen=True)
class MaskUpdateSchedule:
    """Masks move after every ``every_n_steps``-th global step (1-based) before ``until_step``;
    the fraction of each row replaced decays by a cosine from ``drop_fraction`` to 0 at
    ``until_step`` (:func:`~squash.training.mask_update.cosine_drop_fraction`)."""

    every_n_steps: int
    drop_fraction: float
    until_step: int

    @classmethod
    def from_config(cls, block: Any) -> Optional["MaskUpdateSchedule"]:
        """The schedule of a ``mask_update`` config block, None without one.

        Raises:
            ConfigKeyError: a bad or missing key of the block (named).
        """
        parsed = parse_mask_update(block)
        return None if parsed is None else cls(**parsed)

    def due(self, step: int) -> bool:
        """Whether the masks move after global step ``step``."""
        return step % self.every_n_steps == 0 and step < self.until_step

    def drop(self, step: int) -> float:
        """The fraction of each row's entries replaced by the update after ``step``."""
        return cosine_drop_fraction(step, self.drop_fraction, self.until_step)


def mask_update_due(schedule: Optional[MaskUpdateSchedule], step: int) -> bool:
    """Whether a recipe with ``schedule`` (None: no ``mask_update``) moves masks after ``step``."""
    return schedule is not None and schedule.due(step)
