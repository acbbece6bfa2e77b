"""Run by tests/nf4/test_no_global_mutation.py in a fresh process: snapshot every attribute of
torchao's and torchtune's NF4 and LoRA classes (and the tables torchao dispatches NF4 through),
do something with squash, snapshot again, and print, as the last line, a JSON object of what
changed: ``{"changed": {table: [keys]}}`` (keys added, removed or bound to another object).

    python tests/nf4/_mutation_probe.py import            # ``import squash`` after torchao only
    python tests/nf4/_mutation_probe.py run OUT_DIR       # build, train, export and chat
    python tests/nf4/_mutation_probe.py control           # replaces one attribute on purpose
"""

import json
import sys
from pathlib import Path

import torch
import torchao.dtypes.nf4tensor as nf4tensor

REPO = Path(__file__).resolve().parents[2]


def _tables(torchtune: bool = True) -> dict:
    """``{name: mapping}`` of every namespace compared: the classes' own attributes
    (``vars``), torchao's NF4 dispatch tables and the module globals that hold the functions
    torchtune's NF4 modules call. torchtune's modules are imported here (unless not
    ``torchtune``: torchao's and torch's only), so that what torchtune registers on import is in
    the first snapshot too."""
    tables = {"torchao NF4_OPS_TABLE": nf4tensor.NF4_OPS_TABLE,
              "torchao NF4_TORCH_FUNCTIONS": nf4tensor.NF4_TORCH_FUNCTIONS,
              f"globals({nf4tensor.__name__})": vars(nf4tensor)}  # fmt: skip
    classes = [nf4tensor.NF4Tensor, torch.nn.Module, torch.nn.Linear, torch.nn.Parameter]
    tables.update({f"vars({c.__module__}.{c.__qualname__})": vars(c) for c in classes})
    if not torchtune:
        return tables
    import torchtune.modules as tt_modules
    import torchtune.modules.low_precision.nf4_linear as tt_nf4_linear
    import torchtune.modules.peft.lora as tt_lora
    from torchtune.modules.low_precision import FrozenNF4Linear
    from torchtune.modules.peft import DoRALinear, LoRALinear

    classes = [LoRALinear, DoRALinear, FrozenNF4Linear, tt_modules.TransformerDecoder,
               tt_modules.TransformerSelfAttentionLayer]  # fmt: skip
    tables.update({f"vars({c.__module__}.{c.__qualname__})": vars(c) for c in classes})
    for module in (tt_lora, tt_nf4_linear):
        tables[f"globals({module.__name__})"] = vars(module)
    return tables


def snapshot(torchtune: bool = True) -> dict:
    """Every table's keys and the objects they are bound to (held, so that no id is reused)."""
    return {name: {str(k): v for k, v in table.items()}
            for name, table in _tables(torchtune).items()}  # fmt: skip


def _others(key: str, value) -> bool:
    """Whether an attribute that appeared is one Python or transformers adds, whoever runs:
    ``__slotnames__``, copyreg's cache of a class's slot names, set the first time one of its
    objects is copied or pickled (``copy.deepcopy``, ``torch.save``); ``__annotations__``, the
    empty dict Python 3.10+ stores on a class the first time it is read (by ``inspect``,
    ``typing``); ``smart_apply``, which transformers' ``PreTrainedModel`` puts on
    ``torch.nn.Module`` when it builds a model (``squash chat`` builds one)."""
    if key == "__slotnames__":
        return isinstance(value, list)
    if key == "__annotations__":
        return value == {}
    if key == "smart_apply":
        return getattr(value, "__module__", "").startswith("transformers.")
    return False


def changed(before: dict, after: dict) -> dict:
    """``{table: [keys]}`` of keys added, removed or bound to another object, but for the ones
    :func:`_others` adds."""
    out = {}
    for name in before:
        a, b = before[name], after[name]
        keys = sorted(k for k in a.keys() | b.keys()
                      if k not in a or k not in b or a[k] is not b[k])  # fmt: skip
        keys = [k for k in keys if k in a or not _others(k, b[k])]
        if keys:
            out[name] = keys
    return out


def build_models() -> None:
    """Every kind of squash NF4 model, built, loaded, deep-copied and run once."""
    import copy

    from torchtune.models.llama3_2 import qlora_llama3_2_1b  # noqa: F401  (torchtune's own)
    from torchtune.models.llama3_2._component_builders import lora_llama3_2

    from squash.models import squash_llama3_2, squash_qwen2
    from squash.nf4 import quantize_base_, use_squash_nf4_

    tiny = dict(vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=256,
                max_seq_len=16, intermediate_dim=512)  # fmt: skip
    lora = dict(lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8.0)
    models = [
        squash_llama3_2(**tiny, **lora, sparsity=0.5, scale_factor=1,
                        base_outliers={"fraction": 0.02, "criterion": "magnitude"}),
        squash_qwen2(**tiny, **lora, sparsity=0.5, apply_lora_to_mlp=True),
        use_squash_nf4_(lora_llama3_2(**tiny, **lora, scale_factor=1, quantize_base=True)),
        quantize_base_(lora_llama3_2(**tiny, **lora, scale_factor=1)),
    ]  # fmt: skip
    tokens = torch.randint(0, 64, (1, 8))
    for model in models:
        model.load_state_dict(model.state_dict(), strict=False)
        copy.deepcopy(model)(tokens)


def run(out: Path) -> None:
    """``tune run squash_finetune`` on the tiny OPT (a corrected base with sensitivity
    outliers, mask updates every 2 steps, adapter-only checkpoints: the run writes the squash
    and the PEFT adapter), then the merge that ``squash export`` runs before it writes a file
    (:func:`squash.merge.load_checkpoint_model`; GGUF takes Llama and Qwen only) and ``squash
    chat``'s model of the checkpoint (:func:`squash.chat.load_checkpoint`; greedy tokens from
    raw ids: the tiny OPT's tokenizer has no chat template). ``tune run`` through its
    command-line entry point."""
    from safetensors.torch import save_file
    from torchtune._cli.tune import main as tune_main

    from squash.chat import load_checkpoint
    from squash.merge import load_checkpoint_model

    build_models()
    sys.argv = ["tune", "run", "squash_finetune", "--config", str(REPO / "configs/opt_tiny.yaml"),
                f"output_dir={out / 'run'}", "batch_size=4", "epochs=1", "max_steps_per_epoch=4",
                "mask_update.every_n_steps=2", "save_adapter_weights_only=True",
                "model.base_outliers.fraction=0.02", "model.base_outliers.criterion=sensitivity",
                "model.base_outliers.calibration.samples=4",
                "model.base_outliers.calibration.max_seq_len=64"]  # fmt: skip
    try:
        tune_main()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    ckpt = out / "run" / "epoch_0"
    merged = load_checkpoint_model(ckpt).weights
    save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "merged.safetensors"))
    said = list(load_checkpoint(ckpt, template=False).generate([2, 100, 200, 300], 4))
    print(json.dumps({"adapter": sorted(p.name for p in (ckpt / "adapter").iterdir()),
                      "merged": len(merged), "chat": said}))  # fmt: skip


def main() -> None:
    what = sys.argv[1]
    if what == "import":
        before = snapshot(torchtune=False)
        import squash  # noqa: F401

        print(json.dumps({"changed": changed(before, snapshot(torchtune=False)),
                          "torchtune_imported": "torchtune" in sys.modules}))  # fmt: skip
        return
    before = snapshot()
    if what == "run":
        run(Path(sys.argv[2]))
    elif what == "control":  # what squash < 0.4 did once a builder ran
        nf4tensor.NF4Tensor.quantize_tensor_nearest = staticmethod(lambda v, nf4: None)
        nf4tensor.implements([torch.ops.aten.clone.default])(lambda f, *a, **k: None)
    print(json.dumps({"changed": changed(before, snapshot())}))


if __name__ == "__main__":
    main()
