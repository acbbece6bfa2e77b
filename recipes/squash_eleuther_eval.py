"""torchtune's ``eleuther_eval`` recipe, runnable offline and with the lm-eval that works with
transformers 5::

    tune run squash_eleuther_eval --config configs/smollm2_eleuther_eval.yaml

Model set-up, the torchtune model's wrapper (``_LLMEvalWrapper``: tokenization, forward,
generation) and the evaluation are torchtune's, loaded from its wheel. Two things differ:

- torchtune 0.6.1 checks ``version("lm-eval") < "0.4.5"`` as strings, so it refuses lm-eval 0.4.10
  and later ("0.4.13" < "0.4.5"), while lm-eval before 0.4.10 cannot be imported with
  transformers 5 (it needs ``AutoModelForVision2Seq``, removed there). Here the version is
  compared as a version.
- torchtune's wrapper builds lm-eval's ``HFLM`` base from ``pretrained="gpt2"``, which downloads
  GPT-2 from the Hugging Face hub. ``HFLM`` needs a transformers model only for its config at
  construction; here it gets a one-layer stand-in of the checkpoint's own ``config.json`` and the
  checkpoint's tokenizer, then the torchtune model replaces it as torchtune's wrapper does.

squash's local tasks (``squash/eval_tasks``: ``squash_facts``) are always on lm-eval's task path;
``include_path`` (a directory or a list) adds task directories of the user's own.

Raises:
    RuntimeError: lm-eval older than 0.4.5 is installed.
    FileNotFoundError: ``checkpointer.checkpoint_dir`` has no ``config.json`` or tokenizer.
"""

import importlib.util
import sys
from functools import partial
from importlib.metadata import version
from pathlib import Path

import torchtune
from omegaconf import DictConfig
from packaging.version import Version
from torchtune import config, training, utils
from torchtune._recipe_registry import get_all_recipes

import squash  # noqa: F401  (registers ${squash_asset:NAME}, which the configs use)
from squash.config.overrides import overrides_in_one_line
from squash.eval_tasks import TASK_DIR
from squash.training import placement


def _load_torchtune_recipe(name: str):
    """A recipe file of torchtune's wheel as a module, found the way ``tune run`` finds it
    (torchtune forbids importing its ``recipes`` directory as a package)."""
    (recipe,) = [r for r in get_all_recipes() if r.name == name]
    path = Path(torchtune.__file__).parent.parent / "recipes" / recipe.file_path
    spec = importlib.util.spec_from_file_location(f"torchtune_recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_TORCHTUNE_EVAL = _load_torchtune_recipe("eleuther_eval")

# Every top-level key torchtune's eleuther_eval recipe reads (squash validate checks against it).
CONFIG_KEYS = frozenset({
    "output_dir", "model", "checkpointer", "tokenizer", "device", "dtype", "seed", "tasks",
    "include_path", "limit", "max_seq_length", "batch_size", "enable_kv_cache", "quantizer",
    "log_level", "cudnn_deterministic_mode",
})  # fmt: skip
_TorchtuneEleutherEvalRecipe = _TORCHTUNE_EVAL.EleutherEvalRecipe


def _stand_in(hf_dir: Path):
    """A one-layer, width-8 transformers model of ``hf_dir``'s config (the architecture, vocab
    and special ids lm-eval reads), and the checkpoint's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"checkpointer.checkpoint_dir: no config.json in {hf_dir}")
    if not any((hf_dir / name).is_file() for name in ("tokenizer.json", "vocab.json")):
        raise FileNotFoundError(f"checkpointer.checkpoint_dir: no tokenizer.json or vocab.json in {hf_dir}")
    cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    for key, value in (("num_hidden_layers", 1), ("hidden_size", 8), ("intermediate_size", 8),
                       ("num_attention_heads", 1), ("num_key_value_heads", 1), ("head_dim", 8),
                       ("ffn_dim", 8), ("word_embed_proj_dim", 8)):
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg)
    return model, AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)


class _OfflineLLMEvalWrapper(_TORCHTUNE_EVAL._LLMEvalWrapper):
    """torchtune's ``_LLMEvalWrapper`` with ``HFLM`` built from a local stand-in (module
    docstring) instead of the hub's GPT-2."""

    def __init__(self, model, tokenizer, *, hf_dir: Path, device, max_seq_length: int = 4096,
                 batch_size: int = 8, dtype=None, enable_kv_cache: bool = True):  # fmt: skip
        stand_in, hf_tokenizer = _stand_in(Path(hf_dir))
        _TORCHTUNE_EVAL.HFLM.__init__(
            self, pretrained=stand_in.to(device), tokenizer=hf_tokenizer, backend="causal"
        )
        # what torchtune's __init__ sets after its HFLM.__init__
        self._model = model
        self._tokenizer = tokenizer
        self._max_seq_length = max_seq_length
        self._batch_size = batch_size
        self._dtype = dtype
        self._enable_kv_cache = enable_kv_cache


def _task_paths(include_path) -> list:
    """squash's task directory, then the config's ``include_path`` (None, a path or a list)."""
    extra = [] if include_path is None else (
        [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
    )
    paths = [str(TASK_DIR)] + [str(p) for p in extra]
    return list(dict.fromkeys(paths))  # a path named twice is scanned once


class EleutherEvalRecipe(_TorchtuneEleutherEvalRecipe):
    """torchtune's ``EleutherEvalRecipe`` with a numeric lm-eval version check (see the module
    docstring); ``setup`` and ``evaluate`` are torchtune's."""

    def __init__(self, cfg: DictConfig) -> None:
        # torchtune 0.6.1's __init__ less its string comparison of versions
        if Version(version("lm-eval")) < Version("0.4.5"):
            raise RuntimeError(
                "This recipe requires EleutherAI's lm-eval 0.4.5 or newer: pip install 'squash[eval]'"
            )
        self.logger = utils.get_logger(cfg.get("log_level", "info"))
        picked = placement.resolve_config(cfg)  # auto: this host's choice, recorded
        self.logger.info(picked.line())
        self.device = utils.get_device(device=picked.device)
        self.dtype = training.get_dtype(dtype=picked.dtype, device=self.device)
        training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))
        self.limit = cfg.limit
        self.tasks = list(cfg.tasks)
        self.batch_size = cfg.batch_size
        self.enable_kv_cache = cfg.get("enable_kv_cache", True)
        self.include_path = _task_paths(cfg.get("include_path", None))

    def setup(self, cfg: DictConfig) -> None:
        """torchtune's setup, with the offline wrapper for text-only models."""
        _TORCHTUNE_EVAL._LLMEvalWrapper = partial(
            _OfflineLLMEvalWrapper, hf_dir=Path(cfg.checkpointer.checkpoint_dir)
        )
        super().setup(cfg)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point for the recipe."""
    config.log_config(recipe_name="EleutherEvalRecipe", cfg=cfg)
    recipe = EleutherEvalRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.evaluate()


if __name__ == "__main__":
    with overrides_in_one_line("squash_eleuther_eval"):  # a bad override: one line
        sys.exit(recipe_main())
