"""A short squash_finetune run on the downloaded SmolLM2-135M-Instruct (the main job's config, fp32
base, both factors 90% sparse, masks updated every step): its PEFT adapter, applied by PEFT to
transformers' LlamaForCausalLM, and its merged weights, loaded by transformers, give the logits of
squash's own model rebuilt from the squash adapter; a resume from the step-2 checkpoint logs the
losses of the uninterrupted run."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.recipes.conftest import REPO, logged, tune_run

CONFIG = REPO / "configs" / "smollm2_135m.yaml"
TEXT = "The capital of France is Paris. Unicode names characters: LATIN SMALL LETTER N WITH TILDE."


def _overrides(ckpt: Path):
    return [f"checkpointer.checkpoint_dir={ckpt}", f"tokenizer.path={ckpt}",
            "max_steps_per_epoch=4", "batch_size=2", "save_every_n_steps=2", "keep_last_n=4",
            "save_adapter_weights_only=False", "mask_update.every_n_steps=1",
            "mask_update.until_step=4", "heldout.dataset.max_samples=2", "heldout.prompt_index=0",
            "heldout.max_new_tokens=2"]  # fmt: skip


def _squash_logits(ckpt: Path, epoch_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """squash's model as the config builds it, the base from ``ckpt``, the adapter from the
    squash adapter file of ``epoch_dir``."""
    from omegaconf import OmegaConf
    from torchtune import config
    from torchtune.training import FullModelHFCheckpointer

    from squash.training import checkpoint as ckpt_lib

    cfg = OmegaConf.load(CONFIG)
    model = config.instantiate(cfg.model)
    base = FullModelHFCheckpointer(
        checkpoint_dir=str(ckpt), checkpoint_files=["model.safetensors"], model_type="LLAMA3_2",
        output_dir=str(epoch_dir.parent / "unused"),
    ).load_checkpoint()["model"]
    missing, unexpected = model.load_state_dict(base, strict=False)
    assert not unexpected and all(".lora_" in k for k in missing)
    adapter = ckpt_lib.load_squash_adapter(epoch_dir)
    ckpt_lib.load_adapter_into(model, adapter, epoch_dir / ckpt_lib.SQUASH_ADAPTER_FILE)
    with torch.no_grad():
        return model.eval()(ids)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_run_exports_peft_and_merged_weights_and_resumes_exactly(smollm2_checkpoint, tmp_path):
    import transformers
    from peft import PeftModel

    ckpt = smollm2_checkpoint
    out = tmp_path / "run"
    tune_run(out, *_overrides(ckpt), config=CONFIG, timeout=2400)
    uninterrupted = logged(out)
    assert sorted(uninterrupted) == [1, 2, 3, 4]

    epoch = out / "epoch_0"
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    ours = _squash_logits(ckpt, epoch, ids)

    base = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, epoch / "adapter").eval()
    with torch.no_grad():
        peft_logits = peft(ids).logits
    assert (peft_logits - ours).abs().max().item() <= 1e-3

    merged = transformers.LlamaForCausalLM.from_pretrained(epoch, dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = merged(ids).logits
    assert (merged_logits - ours).abs().max().item() <= 1e-3
    # the adapter moved the model: the comparison is not one of two untouched bases
    with torch.no_grad():
        plain = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()(ids).logits
    assert (plain - ours).abs().max().item() > 1e-2

    # resume from step_2: everything after it removed, as a run killed after that save left it
    for p in out.iterdir():
        if p.is_dir() and p.name not in ("step_2", "logs"):
            shutil.rmtree(p)
    tune_run(out, *_overrides(ckpt), "resume_from_checkpoint=True", config=CONFIG, timeout=2400)
    resumed = logged(out)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-6)
