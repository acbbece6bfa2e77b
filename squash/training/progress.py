"""What a training run shows a user: one progress bar over all its optimizer steps (with the
time left), and, when it ends, where its checkpoint, picture and logs are and the commands that
use them, the paths filled in."""

import json
import shlex
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from squash.training.plot import PICTURE, log_dir_of


def training_bar(total_steps: int, steps_done: int) -> tqdm:
    """One bar for the whole run (every epoch), starting at ``steps_done`` (a resumed run): tqdm
    shows the steps done of ``total_steps``, the time spent and the time left."""
    return tqdm(total=total_steps, initial=steps_done, unit="step")


def closing_lines(output_dir: Path, checkpoint: Optional[Path]) -> str:
    """The lines a run prints when it ends: its newest checkpoint, ``training.png`` and log
    directory (those that exist), then ``squash chat`` (where the checkpoint has a chat template)
    and ``squash export`` on the checkpoint."""
    output_dir = Path(output_dir)
    lines = []
    if checkpoint is not None:
        lines.append(f"Checkpoint: {checkpoint}")
    if (output_dir / PICTURE).is_file():
        lines.append(f"Picture:    {output_dir / PICTURE}")
    logs = log_dir_of(output_dir)
    if logs.is_dir():
        lines.append(f"Logs:       {logs}")
    if checkpoint is not None:
        ckpt, gguf = shlex.quote(str(checkpoint)), shlex.quote(str(output_dir / "gguf"))
        lines.append("Next:")
        if has_chat_template(Path(checkpoint)):
            lines.append(f"  squash chat --checkpoint {ckpt}")
        lines.append(f"  squash export {ckpt} --format gguf --dtype q8_0 --output-dir {gguf}")
    return "\n".join(lines)


def has_chat_template(checkpoint: Path) -> bool:
    """Whether ``squash chat`` can talk to ``checkpoint``: its tokenizer files (copied from the
    base model) carry a chat template, in ``chat_template.jinja`` or ``tokenizer_config.json``."""
    if (checkpoint / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
