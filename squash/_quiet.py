"""Keep quiet two third-party messages squash cannot act on (standard library only, so it can run
before torch, torchao and torchdata are imported).

- torchdata's ``'set_vital' is deprecated`` warning, raised by every ``StatefulDataLoader``.
- torchao's ``Skipping import of cpp extensions`` notice: its prebuilt C++ extensions target
  another torch release; squash uses none of them (NF4 is pure PyTorch). The notice is logged
  while torchao is imported, so it is caught only where squash is imported first (``squash``
  commands, scripts): ``tune`` imports torchao before any recipe runs.
"""

import logging
import warnings

TORCHAO_NOTICE = "Skipping import of cpp extensions"
SET_VITAL = "'set_vital' is deprecated"


def _not_torchao_notice(record: logging.LogRecord) -> bool:
    return TORCHAO_NOTICE not in record.getMessage()


def quiet_third_party() -> None:
    """Install both filters (idempotent)."""
    warnings.filterwarnings("ignore", message=SET_VITAL, category=UserWarning)
    torchao_log = logging.getLogger("torchao")
    if _not_torchao_notice not in torchao_log.filters:
        torchao_log.addFilter(_not_torchao_notice)
