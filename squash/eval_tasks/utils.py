"""Dataset loading for the task YAMLs beside this file (lm-eval's ``custom_dataset``).

lm-eval passes ``dataset_kwargs`` (and ``metadata``) to ``custom_dataset``; the ``data_files``
there are names relative to this directory, so a task works from any working directory and
after a regular install.
"""

from pathlib import Path
from typing import Any, Dict, Union

HERE = Path(__file__).resolve().parent


def load_local_json(data_files: Union[str, Dict[str, str]], **_: Any):
    """``datasets.load_dataset("json", data_files=...)`` with each file resolved against this
    directory; returns the ``DatasetDict``.

    Raises:
        FileNotFoundError: a data file that is not here.
    """
    import datasets

    files = {"test": data_files} if isinstance(data_files, str) else dict(data_files)
    resolved = {}
    for split, name in files.items():
        path = (HERE / name).resolve()
        if path.parent != HERE or not path.is_file():
            raise FileNotFoundError(f"lm-eval task data file {name!r} is not in {HERE}")
        resolved[split] = str(path)
    return datasets.load_dataset("json", data_files=resolved)
