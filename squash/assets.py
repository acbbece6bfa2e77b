"""Files that ship with squash (the tiny OPT in ``assets/``), found wherever squash is installed.

Configs name them with the OmegaConf resolver ``${squash_asset:NAME}``, registered when squash
is imported (every squash recipe imports it before its config is resolved), so a config copied
out with ``squash cp`` runs from any directory and after a regular ``pip install .``:

    checkpoint_dir: ${squash_asset:tiny_opt}
    vocab_path: ${squash_asset:tiny_opt}/vocab.json
"""

from pathlib import Path
from typing import List

from omegaconf import OmegaConf

RESOLVER = "squash_asset"


def _roots() -> List[Path]:
    here = Path(__file__).resolve().parent
    # assets/ of a checkout (editable install), else squash/_assets of a regular install
    return [here.parent / "assets", here / "_assets"]


def asset_dir(name: str) -> str:
    """The directory of the shipped asset ``name`` (e.g. ``tiny_opt``), as an absolute path.

    Raises:
        FileNotFoundError: if squash ships no asset of that name (naming the ones it has).
    """
    name = str(name)
    if name == "eval_tasks":  # squash's lm-eval tasks, a package of their own
        return str(Path(__file__).resolve().parent / "eval_tasks")
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise FileNotFoundError(f"${{{RESOLVER}:{name}}}: an asset is named by one plain word")
    for root in _roots():
        if (root / name).is_dir():
            return str(root / name)
    known = sorted({p.name for r in _roots() if r.is_dir() for p in r.iterdir() if p.is_dir()})
    raise FileNotFoundError(f"${{{RESOLVER}:{name}}}: squash ships no asset {name!r}; it has {known}")


def register_resolvers() -> None:
    """Register ``${squash_asset:NAME}`` with OmegaConf (once; later calls do nothing)."""
    if not OmegaConf.has_resolver(RESOLVER):
        # OmegaConf 2.4 renamed register_new_resolver (deprecated there) to register_resolver
        register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
        register(RESOLVER, asset_dir)
