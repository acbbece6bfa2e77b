"""A model is assembled in one pass: each adapted linear and each base module constructed once,
as the class it stays, with no ``__class__`` assignment anywhere along the way (builder, the
recipes' assembly, the load of the one full state dict)."""

from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torchtune.models.llama3_2._component_builders import llama3_2
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import LoRALinear

from squash.assembly.model_setup import assemble_adapter_model, build_adapter_model
from squash.models.smollm2._model_builders import SMOLLM2_135M
from squash.modules import FFILinear, SparseLoRALinear

ALL = ["q_proj", "k_proj", "v_proj", "output_proj"]
# SmolLM2's architecture at a tenth of its width and two layers: the same builders, small shapes
TINY = {**SMOLLM2_135M, "num_layers": 2, "vocab_size": 512, "embed_dim": 64, "num_heads": 4,
        "num_kv_heads": 2, "intermediate_dim": 128, "max_seq_len": 64}  # fmt: skip


def tiny_squash_smollm2(**kwargs):
    """SmolLM2's squash builder with :data:`TINY` sizes (what ``squash_smollm2_135m`` calls)."""
    from squash.models import squash_llama3_2

    return squash_llama3_2(**kwargs, state_dict_dtype=None, **TINY)


@pytest.fixture
def counted(monkeypatch):
    """Counts constructor calls per class and ``__class__`` assignments."""
    calls, swaps = Counter(), []
    for cls in (SparseLoRALinear, LoRALinear, FrozenNF4Linear, FFILinear):
        init = cls.__init__

        def counting(self, *args, _init=init, _cls=cls, **kwargs):
            calls[_cls.__name__] += 1  # subclasses included (NF4LoRALinear is a LoRALinear)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    setattr_ = nn.Module.__setattr__

    def watching(self, name, value):
        if name == "__class__":
            swaps.append(type(self).__name__)
        setattr_(self, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", watching)
    return calls, swaps


def _cfg(component, **extra):
    return OmegaConf.create({"_component_": component, "lora_attn_modules": ALL,
                             "apply_lora_to_mlp": True, "lora_rank": 4, "lora_alpha": 8,
                             **extra})  # fmt: skip


def test_squash_smollm2_135m_builds_each_adapter_and_base_once(counted):
    calls, swaps = counted
    model = build_adapter_model(_cfg("squash.models.squash_smollm2_135m"), device="meta",
                                dtype=torch.float32)  # fmt: skip
    adapters = [m for m in model.modules() if isinstance(m, SparseLoRALinear)]
    assert len(adapters) == 30 * 7
    assert calls["SparseLoRALinear"] == 30 * 7  # one each, no swap, no replacement
    assert calls["LoRALinear"] == 0 and calls["FrozenNF4Linear"] == 0
    assert calls["FFILinear"] == 30 * 7  # sparse_factor a: one FFI factor each
    assert swaps == []


@pytest.mark.parametrize("init", ["lora", "svd"])
def test_assembly_constructs_each_adapter_once_and_loads_one_state_dict(counted, init):
    calls, swaps = counted
    torch.manual_seed(0)
    base = {k: v.clone() for k, v in llama3_2(**TINY).state_dict().items()}
    calls.clear()
    cfg = _cfg("tests.models.test_one_pass.tiny_squash_smollm2", sparsity=0.75, init=init)
    model, svd_init = assemble_adapter_model(cfg, base, device=torch.device("cpu"),
                                             dtype=torch.float32, seed=3)  # fmt: skip
    n = len([m for m in model.modules() if isinstance(m, SparseLoRALinear)])
    assert n == 2 * 7
    # the model's adapters only: SVD factors full tensors (svd_factors), no module of its own
    assert calls["SparseLoRALinear"] == n
    assert swaps == []
    assert (svd_init is not None) == (init == "svd")
    assert not any(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    tokens = torch.randint(0, TINY["vocab_size"], (2, 8))
    assert torch.isfinite(model(tokens)).all()


def test_no_module_of_squash_changes_an_objects_class():
    """Models are built in their final classes, and torchtune's own QLoRA modules are replaced
    (``use_squash_nf4_``; the step benchmark's baseline row the other way round), never
    re-classed: no ``x.__class__ = ...`` in squash, its recipes or its benchmarks."""
    import ast
    from pathlib import Path

    import squash

    repo = Path(squash.__file__).parents[1]
    files = [p for d in ("squash", "recipes", "benchmarks") for p in (repo / d).rglob("*.py")]
    assert len(files) > 50
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            found += [f"{path.name}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr == "__class__"]  # fmt: skip
    assert found == []
