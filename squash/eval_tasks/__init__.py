"""lm-eval tasks that ship with squash and run on local files only (no dataset download).

``TASK_DIR`` is the directory to give lm-eval's ``TaskManager(include_path=...)`` (torchtune's
``eleuther_eval`` recipe: ``include_path=...``); ``python -m squash.eval_tasks`` prints it.
"""

from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent

__all__ = ["TASK_DIR"]
