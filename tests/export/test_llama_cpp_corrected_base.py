"""A SmolLM2 run on a corrected NF4 base (``model.base_outliers``), saved adapter-only and
exported to GGUF by ``squash export``: the file holds the corrected base (plain NF4 plus the
outliers, which ``squash export`` rebuilds from the base model) with the adapters merged, and
llama.cpp runs it. Three files are compared: the downloaded float checkpoint, a one-step run on
plain NF4 and the same run with 1% magnitude outliers; the adapters are taken out again with the
PEFT adapter each run writes (``adapter/``), so the bases themselves can be compared.
"""

import json
import math
from pathlib import Path
from typing import Dict

import pytest
import torch

from tests.export import test_llama_cpp as ref  # skips this module where llama.cpp cannot load
from tests.export.llama_cpp_model import LlamaCppModel

upstream_warnings = ref.upstream_warnings  # the fixture, under its name here
pytestmark = [pytest.mark.gguf_check, pytest.mark.smollm2, pytest.mark.slow]

OUTLIERS = ["model.base_outliers.fraction=0.01", "model.base_outliers.criterion=magnitude"]


@pytest.fixture(scope="module")
def files(smollm2_checkpoint, tmp_path_factory) -> Dict[str, Path]:
    """``{float, nf4, corrected}``: GGUF F16 files; ``{nf4, corrected}_epoch``: the runs'
    adapter-only checkpoints."""
    from squash.cli import main as cli_main
    from squash.export import export_gguf
    from tests.helpers import REPO, tune_run

    root, ckpt = tmp_path_factory.mktemp("corrected_base"), smollm2_checkpoint
    out = {"float": export_gguf(ckpt, "f16", root / "float.gguf")}
    for name, extra in (("nf4", []), ("corrected", OUTLIERS)):
        tune_run(root / name, f"checkpointer.checkpoint_dir={ckpt}", f"tokenizer.path={ckpt}",
                 "max_steps_per_epoch=1", "batch_size=2", "~mask_update",
                 "heldout.dataset.max_samples=3", "heldout.max_new_tokens=1", *extra,
                 config=REPO / "configs" / "smollm2_135m.yaml", timeout=1800)  # fmt: skip
        epoch = root / name / "epoch_0"
        assert not (epoch / "model.safetensors").exists()  # adapter-only: export merges
        args = ["export", str(epoch), "--dtype", "f16", "--output-dir", str(root / name)]
        assert cli_main(args) == 0
        out[name], out[f"{name}_epoch"] = root / name / "epoch_0-f16.gguf", epoch
    return out


def _read(gguf_path: Path) -> Dict[str, torch.Tensor]:
    """The file's weights as transformers' GGUF loader reads them (llama.cpp's layout undone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _peft_deltas(epoch: Path) -> Dict[str, torch.Tensor]:
    """``{weight name: (alpha / r) B A}`` from the run's PEFT adapter (dense factors)."""
    from safetensors.torch import load_file

    config = json.loads((epoch / "adapter" / "adapter_config.json").read_text())
    assert not config.get("use_rslora")
    scale = config["lora_alpha"] / config["r"]
    factors = load_file(epoch / "adapter" / "adapter_model.safetensors")
    out = {}
    for key, a in factors.items():
        if key.endswith(".lora_A.weight"):
            b = factors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            out[name] = scale * b.double() @ a.double()
    return out


def test_the_file_holds_the_corrected_base(files):
    """The corrected file's projections are the weights ``squash export`` merged
    (:func:`load_checkpoint_model`), rounded to F16; with the adapter taken out, each is nearer
    the float weight than plain NF4's; what is not adapted (embeddings, norms) is the float
    checkpoint's in all three files."""
    from squash.merge import load_checkpoint_model

    w = {name: _read(files[name]) for name in ("float", "nf4", "corrected")}
    delta = {name: _peft_deltas(files[f"{name}_epoch"]) for name in ("nf4", "corrected")}
    merged = load_checkpoint_model(files["corrected_epoch"]).weights
    adapted = sorted(delta["corrected"])
    projections = sorted(k for k in w["float"] if k.endswith("proj.weight"))
    assert adapted == sorted(delta["nf4"]) == projections
    assert len(adapted) == 30 * 7  # q, k, v, o, gate, up, down in each of 30 layers
    sq = {"nf4": 0.0, "corrected": 0.0}
    for key in adapted:
        torch.testing.assert_close(w["corrected"][key], merged[key].half().float(), rtol=0, atol=0)
        f = w["float"][key].double()
        err = {n: (w[n][key].double() - delta[n][key] - f).norm().item() for n in sq}
        assert err["corrected"] < err["nf4"], (key, err)
        for n in sq:
            sq[n] += err[n] ** 2
    for key in set(w["float"]) - set(adapted):
        assert torch.equal(w["nf4"][key], w["float"][key]), key
        assert torch.equal(w["corrected"][key], w["float"][key]), key
    print(f"base weight error, corrected / plain NF4 (Frobenius, all projections): "
          f"{math.sqrt(sq['corrected'] / sq['nf4']):.3f}")  # fmt: skip


def test_llama_cpp_runs_the_corrected_base_nearer_the_float_model(
    files, smollm2_checkpoint, upstream_warnings
):
    """llama.cpp loads the corrected file and computes what transformers computes on its
    weights (tokens, logits, perplexity, greedy chat answers: ``check_in_llama_cpp``), and its
    perplexity on the test text lies between the float model's and the plain-NF4 run's."""
    from transformers import AutoTokenizer

    warnings, _ = upstream_warnings
    measured = ref.check_in_llama_cpp(files["corrected"], smollm2_checkpoint, ref.TEXT, "f16", 32,
                                      allowed_warnings=warnings)  # fmt: skip
    ids = AutoTokenizer.from_pretrained(str(smollm2_checkpoint))(
        ref.TEXT, add_special_tokens=False
    ).input_ids
    assert measured["positions"] == len(ids)  # the same tokens scored
    ppl = {"corrected": measured["ppl_llama_cpp"]}
    for name in ("float", "nf4"):
        llm = LlamaCppModel(files[name])
        try:
            ppl[name] = math.exp(ref._nll(llm.logits(ids), ids))
        finally:
            llm.close()
    closed = (ppl["nf4"] - ppl["corrected"]) / (ppl["nf4"] - ppl["float"])
    print(f"llama.cpp perplexity on the test text: {ppl}; the corrected base closes "
          f"{100 * closed:.0f}% of NF4's gap")  # fmt: skip
    assert ppl["float"] < ppl["corrected"] < ppl["nf4"], ppl
