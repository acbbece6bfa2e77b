"""Fixtures for the OPT tests: tiny random-init transformers OPT models saved to tmp dirs."""

import json
from pathlib import Path

import pytest
import torch

import transformers

from squash.models.opt import OPTCheckpointer, opt, opt_args_from_hf_config  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TINY_OPT_DIR = REPO / "assets" / "tiny_opt"

# Two shapes of OPT in miniature: 350m's (post-LayerNorm, token embeddings narrower than the
# hidden size, so project_in/project_out exist, no final LayerNorm) and 125m's (pre-LayerNorm).
HF_CONFIGS = {
    "350m_like": dict(hidden_size=32, word_embed_proj_dim=16, do_layer_norm_before=False),
    "125m_like": dict(hidden_size=32, word_embed_proj_dim=32, do_layer_norm_before=True),
}


def make_hf_opt(name: str = "350m_like", seed: int = 0, **overrides):
    """A seeded random-init ``OPTForCausalLM`` (fp32, eval mode) in which every parameter,
    biases and LayerNorms included, is perturbed so that no weight mapping can hide."""
    kwargs = dict(
        vocab_size=96,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        **HF_CONFIGS[name],
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**kwargs))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def load_squash(checkpoint_dir: Path, output_dir: Path, files=("model.safetensors",)):
    """Build squash's OPT from ``config.json`` and load it through ``OPTCheckpointer``."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    checkpointer = OPTCheckpointer(str(checkpoint_dir), list(files), str(output_dir))
    model = opt(**opt_args_from_hf_config(config))
    model.load_state_dict(checkpointer.load_checkpoint()["model"], strict=True)
    return model.eval(), checkpointer


@pytest.fixture(params=sorted(HF_CONFIGS))
def hf_opt_dir(request, tmp_path):
    """``(name, hf_model, checkpoint_dir)`` for each config, saved with ``save_pretrained``."""
    model = make_hf_opt(request.param)
    path = tmp_path / f"hf_{request.param}"
    model.save_pretrained(path)
    return request.param, model, path


@pytest.fixture
def make_hf():
    """The :func:`make_hf_opt` factory."""
    return make_hf_opt


@pytest.fixture
def squash_loader():
    """The :func:`load_squash` helper."""
    return load_squash


@pytest.fixture
def tiny_opt_dir():
    """The tiny OPT shipped in ``assets/tiny_opt``."""
    return TINY_OPT_DIR
