"""Helpers tests share (a plain module; conftest.py files hold fixtures only): run the real
``tune run`` and read what the run logged, re-hash an edited checkpoint, a stand-in
checkpointer, the NF4 reference Llama, and the pinned losses of ``configs/opt_tiny.yaml``. Imported as ``tests.helpers``, which
``python -m pytest`` from the repository root (as CI runs it) finds."""

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Dict, List


REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "opt_tiny.yaml"
TUNE = str(Path(sys.executable).with_name("tune"))

# Small, quick runs of configs/opt_tiny.yaml: 4 samples a step, on the CPU in fp32 (the configs'
# device: auto and dtype: auto would pick a GPU or bf16 on other hosts, and the numbers tests pin
# and compare are the CPU's in fp32; tests/training/test_placement.py and the recipe test of auto
# cover auto itself).
QUICK = ["batch_size=4", "log_every_n_steps=1", "device=cpu", "dtype=fp32"]

# Losses of the first steps of configs/opt_tiny.yaml with QUICK overrides, seed 1234, recorded
# from squash_finetune (tests/recipes/test_squash_finetune.py; step 1 is also checked there
# against an independent computation); other recipes' tests compare with them. Steps 3 and 4
# depend on the initial adapter (drawn per module from (seed, name) since the distributed
# recipe, see squash.assembly.adapter_init), steps 1 and 2 do not (B = 0, lr = 0 at step 1).
PINNED = {1: 6.929374679158111, 2: 6.926835632324218, 3: 6.91680344012605, 4: 6.894303226237775}


def declare_dtype(path: Path, old: str, new: str) -> str:
    """Rewrite ``path``'s safetensors header, declaring each ``old`` dtype as ``new`` (the data
    bytes unchanged, as a file written with a wrong header would be); returns a tensor's name."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    for key, info in header.items():
        if key != "__metadata__" and info["dtype"] == old:
            info["dtype"] = new
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + size :])
    return next(k for k in header if k != "__metadata__")


def tree(path: Path) -> Dict[str, object]:
    """``{relative path: sha256}`` of everything under ``path`` (directories as None); None
    when ``path`` does not exist."""
    path = Path(path)
    if not path.exists():
        return None
    return {
        p.relative_to(path).as_posix():
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(path.rglob("*"))
    }


class StubCheckpointer:
    """A stand-in for the model's checkpointer with the interface
    ``squash.runs.checkpoint.write_checkpoint`` uses: it writes a PEFT config and a 1 KiB
    weight file into ``<output_dir>/epoch_N``."""

    def __init__(self, output_dir):
        self._output_dir = Path(output_dir)

    def save_checkpoint(self, state, epoch, intermediate_checkpoint=False, adapter_only=False):
        out = self._output_dir / f"epoch_{epoch}"
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text('{"r": 1}')
        (out / "model.safetensors").write_bytes(bytes(range(256)) * 4)


def tune_run(output_dir: Path, *overrides: str, recipe: str = "squash_finetune",
             config: Path = TINY_CONFIG, cwd: Path = REPO, check: bool = True,
             timeout: int = 600, env: Dict[str, str] = None,
             nproc: int = 0) -> subprocess.CompletedProcess:
    """``tune run [--standalone --nproc_per_node NPROC] RECIPE --config CONFIG output_dir=...
    OVERRIDES`` in ``cwd`` (``--standalone``: torchrun on a free port)."""
    cmd = [TUNE, "run", *launcher(nproc), recipe, "--config", str(config),
           f"output_dir={output_dir}", *QUICK, *overrides]
    env = {**run_env(), "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_env() -> Dict[str, str]:
    """This process's environment without tqdm's ``TQDM_*`` settings (``TQDM_DISABLE=1`` in a
    caller's shell hides every bar): a run under test shows what a user's default shell shows."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}


def launcher(nproc: int) -> List[str]:
    """``tune run`` options that start ``nproc`` processes on this machine (none for 0)."""
    return ["--standalone", "--nproc_per_node", str(nproc)] if nproc else []


def logged(output_dir: Path, key: str = "loss") -> Dict[int, float]:
    """``{step: value}`` of ``key`` from the DiskLogger files of a run (later files win)."""
    values: Dict[int, float] = {}
    files: List[Path] = sorted((output_dir / "logs").glob("log_*.txt"), key=os.path.getmtime)
    for path in files:
        for line in path.read_text().splitlines():
            m = re.match(r"Step (\d+) \| (.*)", line)
            if not m:
                continue
            fields = dict(item.split(":", 1) for item in m.group(2).split())
            if key in fields:
                values[int(m.group(1))] = float(fields[key])
    return values


def assembled_from_checkpoint(ckpt_dir: Path, scratch: Path):
    """The tiny OPT model as a recipe assembles it from the model block ``ckpt_dir`` recorded
    (``squash_adapter_config.json``: a corrected base is split again, calibrated with the tiny
    OPT's tokenizer), base weights from assets/, with the checkpoint's adapter loaded.
    ``scratch``: a directory for the checkpointer's output."""
    import torch
    from omegaconf import OmegaConf

    from squash.assembly.model_setup import assemble_adapter_model
    from squash.models.opt import OPTCheckpointer, opt_tokenizer
    from squash.runs import checkpoint as ckpt

    tiny = REPO / "assets" / "tiny_opt"
    block = json.loads((ckpt_dir / "squash_adapter_config.json").read_text())["model"]
    tok = opt_tokenizer(str(tiny / "vocab.json"), str(tiny / "merges.txt"))
    base = OPTCheckpointer(str(tiny), ["model.safetensors"], str(scratch))
    model = assemble_adapter_model(OmegaConf.create(block), base.load_checkpoint()["model"],
                                   device=torch.device("cpu"), dtype=torch.float32, seed=1234,
                                   tokenizer=tok).model  # fmt: skip
    ckpt.load_adapter_into(model, ckpt.load_squash_adapter(ckpt_dir), ckpt_dir)
    return model


def rehash_checkpoint(path: Path) -> None:
    """Rewrite ``path/checkpoint.json`` to match the files as they now are (what a writer that
    saved them so would have recorded), keeping its counters and config: lets a test reach the
    checks behind the integrity check."""
    from squash.runs import manifest

    meta = json.loads((path / "checkpoint.json").read_text())
    meta["files"] = manifest.file_table(path)
    meta["sha256"] = manifest._self_hash(meta)
    (path / "checkpoint.json").write_text(json.dumps(meta))


def nf4_reference_llama(checkpoint_dir: Path):
    """transformers' ``LlamaForCausalLM`` of an HF checkpoint (fp32) whose decoder linears are
    replaced by torchao's dequantization of their NF4 quantization, with the block sizes squash
    picks (``nf4_block_sizes``). Each weight is quantized in torchtune's layout, where squash's
    NF4 base holds it (q and k rows permuted for torchtune's RoPE), and converted back, so this
    is the model an NF4 base computes, built from transformers and torchao alone."""
    import torch
    import transformers
    from torchao.dtypes.nf4tensor import to_nf4
    from torchtune.models.convert_weights import hf_to_tune, tune_to_hf

    from squash.nf4 import nf4_block_sizes

    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
    c = model.config
    sizes = dict(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                 dim=c.hidden_size)  # fmt: skip
    tune = hf_to_tune(model.state_dict(), **sizes)
    for key, value in tune.items():
        if key.startswith("layers.") and value.dim() == 2:  # the seven linears of each layer
            block, scaler = nf4_block_sizes(key, tuple(value.shape))
            tune[key] = to_nf4(value.contiguous(), block, scaler).get_original_weight()
    missing, unexpected = model.load_state_dict(tune_to_hf(tune, **sizes), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def finetune_in_process(cfg):
    """``squash_finetune``'s recipe on ``cfg`` in this process (setup, train, cleanup even on an
    error); returns the recipe, its model as trained."""
    sys.path.insert(0, str(REPO / "recipes"))
    import squash_finetune

    recipe = squash_finetune.SquashFinetuneRecipeSingleDevice(cfg)
    try:
        recipe.setup(cfg)
        recipe.train()
    finally:
        recipe.cleanup()
    return recipe
