"""squash.assembly.model_setup's loader of everything but the adapters, against the tensors it
was given."""

import pytest
import torch

from squash.assembly.model_setup import load_all_but_adapters


def test_load_all_but_adapters_names_what_does_not_fit():
    layer = torch.nn.ModuleDict({"base": torch.nn.Linear(2, 2), "lora_a": torch.nn.Linear(2, 1)})
    model = torch.nn.ModuleDict({"q": layer})
    adapter = layer["lora_a"].weight.detach().clone()
    weights = {"q.base.weight": torch.ones(2, 2), "q.base.bias": torch.zeros(2)}
    load_all_but_adapters(model, weights, "x")
    assert torch.equal(layer["base"].weight, torch.ones(2, 2))
    assert torch.equal(layer["lora_a"].weight, adapter)  # the adapter keeps its values
    with pytest.raises(ValueError,
                       match=r"the base: missing \['q.base.bias'\], unexpected \['x'\]"):
        load_all_but_adapters(model, {"q.base.weight": torch.ones(2, 2), "x": torch.ones(1)},
                                  "the base")
