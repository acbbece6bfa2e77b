"""Print the directory of squash's lm-eval tasks (for ``include_path=$(python -m squash.eval_tasks)``)."""

from squash.eval_tasks import TASK_DIR

print(TASK_DIR)
