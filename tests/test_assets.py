"""``${squash_asset:NAME}``: configs name the shipped files wherever squash is installed."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import squash  # noqa: F401  (registers the resolver)
from squash.assets import asset_dir

REPO = Path(__file__).resolve().parents[1]


def test_the_resolver_gives_the_checkouts_tiny_opt():
    cfg = OmegaConf.create({"d": "${squash_asset:tiny_opt}", "f": "${squash_asset:tiny_opt}/vocab.json"})
    assert Path(cfg.d) == REPO / "assets" / "tiny_opt"
    assert Path(cfg.f).read_bytes() == (REPO / "assets" / "tiny_opt" / "vocab.json").read_bytes()


def test_shipped_opt_tiny_config_resolves_to_existing_files():
    cfg = OmegaConf.load(REPO / "configs" / "opt_tiny.yaml")
    for value in (cfg.tokenizer.vocab_path, cfg.tokenizer.merges_path, cfg.dataset.data_files):
        assert Path(value).is_file() and Path(value).is_absolute()
    assert (Path(cfg.checkpointer.checkpoint_dir) / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["no_such_asset", "../assets", ""])
def test_an_unknown_asset_is_a_clear_error(name):
    with pytest.raises(FileNotFoundError, match="squash_asset"):
        asset_dir(name)
