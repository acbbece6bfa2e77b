"""Memory and speed of a fine-tuning step: squash against torchtune's QLoRA, side by side.

On an OPT-350M-shaped model (hidden 1024, MLP 4096, vocabulary 50,272; ``--layers`` of its 24
layers; random weights, or ``--checkpoint-dir`` with a real HF checkpoint; adapters on q, k, v,
output projections and both MLP linears) or, with ``--model smollm2``, on SmolLM2-135M (30 layers,
hidden 576, MLP 1536, 3 KV heads, tied embeddings; adapters on all seven linears; the real
weights from ``--checkpoint-dir``, what ``squash download smollm2-135m-instruct`` wrote, or random
ones; the tied head computed as squash's builders compute it, ``FlatTiedLinear``, in every
row), one process builds every row's model and times their training steps (forward, backward,
AdamW step) in interleaved rounds, so load from elsewhere hits all rows alike. The rows:

- ``torchtune QLoRA r``: torchtune's ``LoRALinear`` on NF4 weights, computed with torchao's
  ``linear_nf4`` (what torchtune's ``lora_finetune_single_device`` trains with a torchtune
  ``qlora_*`` model): the baseline.
- ``squash's QLoRA r``: the same dense adapters computed with squash's NF4 kernel
  (``NF4LoRALinear``, what squash's ``qlora_*`` builders and recipes build; equal bit for bit).
- ``squash r, A 90%``, and squash at the largest ranks whose adapter + gradient + AdamW bytes fit
  in the baseline's (``squash.training.max_rank_within``), with A 90% sparse and with A and B.
- the same with a mask update every ``--mask-every`` steps (update steps timed on their own).
- ``bound``: the A+B model with its adapters switched off (``disabled``; the gradient still runs
  back through every layer to the embeddings' output): the step that no adapter on squash's NF4
  base can beat, so ``bound / torchtune QLoRA`` is the lowest ratio any squash adapter could
  reach.
- ``LoRA r, no quantization``: dense base weights.

Each row also gets its step's matmul floor: the matmul FLOPs of its step (``profile_step.py``'s
``model_flops``: base linears forward and input gradient, adapter factors at their density, the
output head, attention) divided by this host's dense matmul rate, measured in the same process.

Peak memory is measured per row in a fresh process, during one step after a warm-up step (on
the CPU the process's peak resident memory, VmHWM, reset through ``/proc/self/clear_refs``; on a
GPU ``torch.cuda.max_memory_allocated``), and, for the mask row, during the step that records
growth candidates and updates the masks. Then the real recipes run on
the same model for a few steps (``tune run lora_finetune_single_device`` with torchao's NF4
(``SQUASH_NF4=torchao``), ``tune run squash_finetune`` with squash's QLoRA and with squash A+B,
one after the other in each of ``--recipe-rounds`` rounds) and their logged tokens/s (median and
range over the rounds, and each over torchtune's in each round) and peak memory are added, so
the script's numbers can be tied to what the recipes do. Below the table, each row's step over
the first row's, round by round, and each timed step's system CPU time and minor page faults
(a step that the kernel slowed shows there). The table is printed and written to
``benchmarks/results/``, with its numbers as JSON and a picture of the step times (PNG, the
``plot`` extra) beside it; ``plot`` redraws the picture from a stored results file, timing
nothing (``finetune_plot.py``).

    python benchmarks/finetune.py --layers 6                 # ~8 minutes on 2 CPU cores
    python benchmarks/finetune.py --device cuda --dtype bf16 # all 24 layers on a GPU
    python benchmarks/finetune.py --model smollm2 --checkpoint-dir DIR   # SmolLM2-135M, 30 layers
    python benchmarks/finetune.py plot benchmarks/results/FILE.md --png docs/benchmarks/NAME.png
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import finetune_plot
from common import (DTYPES, OPT_350M, SMOLLM2_135M, adapted_shapes, kernels, machine_line,
                    make_timer)  # fmt: skip
from profile_step import dense_rate, host_counters, host_since, model_flops

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SIZES = {"opt350m": OPT_350M, "smollm2": SMOLLM2_135M}  # squash's builders' sizes
FAMILIES = {"opt350m": ("OPT-350M", OPT_350M["num_layers"]),
            "smollm2": ("SmolLM2-135M", SMOLLM2_135M["num_layers"])}  # name, layers
MODULES = ["q_proj", "k_proj", "v_proj", "output_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", dest="family", choices=sorted(FAMILIES), default="opt350m")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: all, OPT-350M 24, SmolLM2 30)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample")
    p.add_argument("--rank", type=int, default=16, help="the baseline's rank")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (after 1 warm-up)")
    p.add_argument("--mask-every", type=int, default=2, help="mask update every N steps")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU")
    p.add_argument("--checkpoint-dir", default=None,
                   help="a real HF checkpoint directory of the --model family")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="of the random model (smaller: a quick check of the script)")
    p.add_argument("--no-recipes", action="store_true", help="skip the tune run rows")
    p.add_argument("--recipe-rounds", type=int, default=3,
                   help="rounds of the two tune run recipes, one after the other in each round")
    p.add_argument("--out", default=str(RESULTS), help="directory for the table")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # child: one row's peak memory
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    sizes = {k: v for k, v in SIZES[args.family].items() if k != "num_layers"}  # --layers
    args.model = dict(sizes, vocab_size=args.vocab_size or sizes["vocab_size"])
    args.layers = args.layers or FAMILIES[args.family][1]
    if args.family == "smollm2" and not args.no_recipes and not args.checkpoint_dir:
        p.error("--model smollm2 runs the recipes on the real model: give --checkpoint-dir "
                "(squash download smollm2-135m-instruct --output-dir DIR) or --no-recipes")
    if args.recipe_rounds < 1:
        p.error(f"--recipe-rounds must be at least 1, got {args.recipe_rounds}")
    if args.steps <= args.mask_every:
        p.error(f"--steps ({args.steps}) must exceed --mask-every ({args.mask_every})")
    return args


# ---- the rows -------------------------------------------------------------------------------------
def shapes(args):
    """``(in, out)`` of every adapted linear."""
    return adapted_shapes(args.family, args.layers, args.model)


def rows(args):
    """``[(label, lora_opt kwargs, mask update?)]``; squash's ranks fill the baseline's bytes."""
    from squash.training import lora_adapter_memory, max_rank_within

    dtype, s = DTYPES[args.dtype], args.sparsity
    budget = lora_adapter_memory(shapes(args), args.rank, dtype=dtype).total_bytes
    r_both = max_rank_within(budget, shapes(args), sparsity=s, sparse_factor="both", dtype=dtype)
    r_a = max_rank_within(budget, shapes(args), sparsity=s, sparse_factor="a", dtype=dtype)
    r, pct = args.rank, f"{round(s * 100)}%"
    q = dict(quantize_base=True)
    both = dict(lora_rank=r_both, sparsity=s, sparse_factor="both", **q)
    return [
        (f"torchtune QLoRA r={r}", dict(lora_rank=r, nf4="torchao", **q), False),
        (f"squash's QLoRA r={r}", dict(lora_rank=r, **q), False),
        (f"squash r={r}, A {pct}", dict(lora_rank=r, sparsity=s, sparse_factor="a", **q), False),
        (f"squash r={r_a}, A {pct}", dict(lora_rank=r_a, sparsity=s, sparse_factor="a", **q), False),
        (f"squash r={r_both}, A+B {pct}", both, False),
        (f"squash r={r_both}, A+B {pct}, mask update", both, True),
        (f"bound: squash r={r_both}, A+B {pct}, adapters off", dict(both, off=True), False),
        (f"LoRA r={r}, no quantization", dict(lora_rank=r, quantize_base=False), False),
    ]  # fmt: skip


def build(args, kwargs, base_state_dict):
    """A row's model and optimizer. ``kwargs`` are the builder's, and two of the script's own:
    ``nf4="torchao"`` (torchtune's own NF4 modules: torchao's ``linear_nf4``) and ``off=True``
    (adapters switched off, the gradient still reaching every layer)."""
    from torchtune import training
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from squash.models.opt import lora_opt

    kwargs = dict(kwargs)
    torchao, off = kwargs.pop("nf4", None) == "torchao", kwargs.pop("off", False)
    with training.set_default_dtype(DTYPES[args.dtype]), torch.device(args.device):
        if args.family == "opt350m":
            model = lora_opt(MODULES, True, num_layers=args.layers,
                             lora_alpha=2 * kwargs["lora_rank"], **args.model, **kwargs)  # fmt: skip
        else:
            model = _smollm2(args, **kwargs)
    model.load_state_dict(base_state_dict, strict=False)
    set_trainable_params(model, get_adapter_params(model))
    if torchao:
        as_torchtune_nf4_(model)
    if off:
        switch_adapters_off_(model)
    model.set_num_output_chunks(8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, optimizer


def _smollm2(args, lora_rank, quantize_base, sparsity=None, sparse_factor="a"):
    """SmolLM2 with ``args.layers`` layers as ``squash.models.smollm2``'s builders build it, in
    one pass (:func:`squash.models.squash_llama3_2`: NF4 bases with block sizes chosen per
    weight, FFI-sparse adapters or, with ``sparsity=None``, torchtune's dense ones, the tied
    head computed by ``FlatTiedLinear``)."""
    from squash.models import squash_llama3_2

    return squash_llama3_2(MODULES, True, num_layers=args.layers, lora_rank=lora_rank,
                           lora_alpha=2 * lora_rank, quantize_base=quantize_base,
                           sparsity=sparsity, sparse_factor=sparse_factor, state_dict_dtype=None,
                           **args.model)  # fmt: skip


def as_torchtune_nf4_(model):
    """The inverse of ``squash.nf4.use_squash_nf4_``: each ``NF4LoRALinear`` replaced by
    torchtune's own ``LoRALinear`` and each ``NF4Linear`` by its ``FrozenNF4Linear`` (torchao's
    ``linear_nf4``), in place. Each replacement is built by torchtune's constructor on the meta
    device with the NF4 block sizes of the weight it takes (torchtune passes them to ``to_nf4``),
    then given the old module's NF4 weight, factors and dropout: the same tensors."""
    from torchtune.modules.low_precision import FrozenNF4Linear
    from torchtune.modules.peft import LoRALinear

    from squash.nf4 import NF4Linear, NF4LoRALinear

    for name, m in list(model.named_modules()):
        if type(m) not in (NF4LoRALinear, NF4Linear):
            continue
        blocks = dict(block_size=m.weight.block_size, scaler_block_size=m.weight.scaler_block_size)
        if type(m) is NF4LoRALinear:
            with torch.device("meta"):
                new = LoRALinear(m.in_dim, m.out_dim, m.rank, m.alpha, use_bias=m.use_bias,
                                 quantize_base=True, **blocks)  # fmt: skip
            for key in ("weight", "bias", "dropout", "lora_a", "lora_b"):
                setattr(new, key, getattr(m, key))
            new.disabled, new.merged = m.disabled, m.merged
        else:
            with torch.device("meta"):
                new = FrozenNF4Linear(m.in_features, m.out_features, bias=m.bias is not None,
                                      dtype=m.weight.dtype, **blocks)  # fmt: skip
            new.weight, new.bias = m.weight, m.bias
        new.train(m.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model


def switch_adapters_off_(model):
    """Every adapter ``disabled`` (its module computes the base alone), and the token embeddings'
    output made to require a gradient, so that the backward still runs through every layer."""
    from squash.modules import get_adapter_modules

    for m in get_adapter_modules(model).values():
        m.disabled = True
    model.tok_embeddings.register_forward_hook(lambda mod, args, out: out.requires_grad_())
    return model


def make_batch(args):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, args.model["vocab_size"], (args.batch, args.seq_len), generator=g)
    return tokens.to(args.device)


def train_step(model, optimizer, tokens, mask_update_drop=None):
    """One step; with ``mask_update_drop``, record growth candidates and update the masks."""
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    from squash.training import record_grow_candidates, update_masks

    if mask_update_drop is not None:
        record_grow_candidates(model, mask_update_drop)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
    loss = CEWithChunkedOutputLoss(num_output_chunks=8)(model(tokens), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if mask_update_drop is not None:
        update_masks(model, optimizer, mask_update_drop)
    return loss.item()


def base_state_dict(args, ckpt_dir: Path):
    from torchtune.training import FullModelHFCheckpointer

    from squash.models.opt import OPTCheckpointer

    with tempfile.TemporaryDirectory() as out:
        if args.family == "opt350m":
            loader = OPTCheckpointer(str(ckpt_dir), _weight_files(ckpt_dir), out)
        else:
            loader = FullModelHFCheckpointer(str(ckpt_dir), _weight_files(ckpt_dir), "LLAMA3_2", out)
        sd = loader.load_checkpoint()
    return {k: v.to(DTYPES[args.dtype]) for k, v in sd["model"].items()}


def _weight_files(ckpt_dir: Path):
    index = sorted(ckpt_dir.glob("*.index.json"))
    if index:
        return [index[0].name]
    return sorted(p.name for p in ckpt_dir.iterdir() if p.suffix in (".safetensors", ".bin"))


def write_random_checkpoint(args, path: Path) -> Path:
    """An OPT-350M-shaped HF checkpoint with ``args.layers`` layers and random weights, plus the
    tiny OPT's tokenizer files (its ids are a subset of OPT's); or a SmolLM2-shaped one (no
    tokenizer: its recipe rows need the real checkpoint)."""
    import transformers

    if args.family == "smollm2":
        m = args.model
        config = transformers.LlamaConfig(
            vocab_size=m["vocab_size"], hidden_size=m["embed_dim"], intermediate_size=m["intermediate_dim"],
            num_hidden_layers=args.layers, num_attention_heads=m["num_heads"],
            num_key_value_heads=m["num_kv_heads"], rope_theta=m["rope_base"],
            rms_norm_eps=m["norm_eps"], tie_word_embeddings=True, max_position_embeddings=8192,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        return path

    m = args.model
    config = transformers.OPTConfig(
        vocab_size=m["vocab_size"], hidden_size=m["embed_dim"], num_hidden_layers=args.layers,
        ffn_dim=m["intermediate_dim"], num_attention_heads=m["num_heads"],
        max_position_embeddings=m["max_seq_len"], word_embed_proj_dim=m["word_embed_proj_dim"],
        do_layer_norm_before=m["pre_norm"], dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.OPTForCausalLM(config).save_pretrained(path)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(REPO / "assets" / "tiny_opt" / name, path / name)
    return path


# ---- measuring ------------------------------------------------------------------------------------
def _reset_peak(device: str) -> None:
    """Start a new peak: the kernel's high-water mark of resident memory (VmHWM, reset through
    /proc/self/clear_refs) on the CPU, the allocator's peak on a GPU."""
    if device == "cpu":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    else:
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int:
    """Bytes: peak resident memory of this process (CPU) or peak allocated (GPU) since
    :func:`_reset_peak`."""
    if device != "cpu":
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def peak_child(args, ckpt_dir: Path, index: int) -> dict:
    """In this (fresh) process: build row ``index``, run a warm-up step, then measure the peak
    memory of one step (and, for the mask row, of an update step)."""
    label, kwargs, mask = rows(args)[index]
    base = base_state_dict(args, ckpt_dir)
    model, optimizer = build(args, kwargs, base)
    del base
    tokens = make_batch(args)
    train_step(model, optimizer, tokens)  # warm-up: optimizer state exists from here on
    _reset_peak(args.device)
    train_step(model, optimizer, tokens)
    result = {"step_peak": _peak(args.device)}
    if mask:
        _reset_peak(args.device)
        train_step(model, optimizer, tokens, mask_update_drop=0.3)
        result["update_peak"] = _peak(args.device)
    return result


def measure_peaks(args, ckpt_dir: Path) -> list:
    peaks = []
    for i in range(len(rows(args))):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--row", str(i),
               "--checkpoint-dir", str(ckpt_dir)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"peak-memory run of row {i} failed:\n{proc.stderr[-3000:]}")
        peaks.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  peak memory of row {i + 1}/{len(rows(args))} measured", flush=True)
    return peaks


def time_rows(args, ckpt_dir: Path) -> list:
    """Median step seconds of every row, timed in interleaved rounds in this process."""
    from squash.training import adapter_memory

    base = base_state_dict(args, ckpt_dir)
    built, flops = [], []
    head_dim = args.model["embed_dim"] // args.model["num_heads"]
    for label, kwargs, mask in rows(args):
        model, optimizer = build(args, kwargs, base)
        built.append((label, model, optimizer, mask, adapter_memory(model)))
        flops.append(model_flops(model, args.batch, args.seq_len, head_dim)["total"])
    del base
    rate = dense_rate(args.batch * args.seq_len, args.model["embed_dim"], DTYPES[args.dtype],
                      args.device)  # fmt: skip
    tokens = make_batch(args)
    rounds = [[] for _ in built]  # step seconds of each timed round; None: a mask-update step
    update_times = [[] for _ in built]
    host = [[] for _ in built]  # (minor page faults, system CPU s) of each timed round's step
    timed = make_timer(args.device)
    for round_ in range(args.steps + 1):  # round 0 warms up
        for i, (label, model, optimizer, mask, _) in enumerate(built):
            drop = 0.3 if mask and round_ > 0 and round_ % args.mask_every == 0 else None
            before = host_counters()
            ms = timed(lambda: train_step(model, optimizer, tokens, mask_update_drop=drop))
            seconds = ms / 1e3
            if round_ > 0:
                host[i].append(host_since(before))
                rounds[i].append(None if drop is not None else seconds)
                if drop is not None:
                    update_times[i].append(seconds)
        print(f"  timing round {round_}/{args.steps} done", flush=True)
    times = [[s for s in r if s is not None] for r in rounds]
    return [
        dict(label=label, memory=mem, step_s=statistics.median(times[i]),
             step_spread=(min(times[i]), max(times[i])), rounds=rounds[i], host=host[i],
             floor_s=flops[i] / rate,
             flops=flops[i], rate=rate,
             update_s=statistics.median(update_times[i]) if update_times[i] else None)
        for i, (label, _, _, _, mem) in enumerate(built)
    ]  # fmt: skip


# ---- the recipes --------------------------------------------------------------------------------
def recipe_config(args, ckpt_dir: Path, out: Path, recipe: str, sparse: bool) -> Path:
    """The config of one recipe run: dense LoRA rank ``--rank`` on NF4 bases, or (``sparse``)
    squash A+B at the rank of the A+B row."""
    squash = recipe == "squash_finetune"
    r_both = next(kw["lora_rank"] for _, kw, m in rows(args)
                  if kw.get("sparse_factor") == "both" and not m)
    sparse_kw = dict(lora_rank=r_both, lora_alpha=2 * r_both, sparsity=args.sparsity,
                     sparse_factor="both")
    if args.family == "opt350m":
        model = {"_component_": "squash.models.opt.lora_opt", "lora_attn_modules": MODULES,
                 "apply_lora_to_mlp": True, "num_layers": args.layers, **args.model,
                 "lora_rank": args.rank, "lora_alpha": 2 * args.rank, "quantize_base": True}
        if sparse:
            model.update(sparse_kw)
        tokenizer = {"_component_": "squash.models.opt.opt_tokenizer",
                     "vocab_path": str(ckpt_dir / "vocab.json"),
                     "merges_path": str(ckpt_dir / "merges.txt"), "max_seq_len": args.seq_len}
        checkpointer = {"_component_": "squash.models.opt.OPTCheckpointer"}
    else:  # the real SmolLM2 (30 layers): squash's builders, torchtune's HF checkpointer
        builder = "squash_smollm2_135m" if sparse else "lora_smollm2_135m"
        model = {"_component_": f"squash.models.smollm2.{builder}", "lora_attn_modules": MODULES,
                 "apply_lora_to_mlp": True, "lora_rank": args.rank, "lora_alpha": 2 * args.rank,
                 "quantize_base": True, **(sparse_kw if sparse else {})}
        tokenizer = {"_component_": "squash.models.smollm2.smollm2_tokenizer",
                     "path": str(ckpt_dir), "max_seq_len": args.seq_len}
        checkpointer = {"_component_": "torchtune.training.FullModelHFCheckpointer",
                        "model_type": "LLAMA3_2"}
    checkpointer.update(checkpoint_dir=str(ckpt_dir), checkpoint_files=_weight_files(ckpt_dir),
                        output_dir=str(out))
    text = out.parent / "corpus.txt"
    text.write_text((REPO / "assets" / "tiny_opt" / "corpus.txt").read_text() * 40)
    cfg = {
        "output_dir": str(out), "model": model, "seed": 0, "shuffle": False,
        "tokenizer": tokenizer, "checkpointer": checkpointer,
        "resume_from_checkpoint": False, "save_adapter_weights_only": True,
        "dataset": {"_component_": "torchtune.datasets.text_completion_dataset",
                    "source": "text", "data_files": str(text), "packed": True},
        "batch_size": args.batch,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 1},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "epochs": 1, "max_steps_per_epoch": args.steps + 1, "gradient_accumulation_steps": 1,
        "compile": False, "device": args.device, "dtype": args.dtype,
        "enable_activation_checkpointing": False, "enable_activation_offloading": False,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": str(out / "logs")},
        "log_every_n_steps": 1, "log_peak_memory_stats": True,
    }  # fmt: skip
    if not squash:
        cfg["clip_grad_norm"] = None
    path = out.parent / f"{out.name}.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


def run_recipe(args, ckpt_dir: Path, work: Path, run: tuple) -> dict:
    """One recipe run of ``RECIPE_RUNS``: its tokens/s (median of the logged steps after the
    first) and peak memory."""
    label, recipe, sparse, nf4 = run
    out = work / f"run_{recipe}_{'sparse' if sparse else 'dense'}"  # not a module's name
    cfg = recipe_config(args, ckpt_dir, out, recipe, sparse)
    tune = str(Path(sys.executable).with_name("tune"))
    env = dict(os.environ, SQUASH_NF4=nf4)
    proc = subprocess.Popen([tune, "run", recipe, "--config", str(cfg)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"tune run {recipe} failed:\n{output[-3000:]}")
    later = logged_steps(out / "logs")
    tps = statistics.median(float(v["tokens_per_second_per_gpu"]) for v in later)
    if args.device == "cpu":
        peak = usage.ru_maxrss * 1024  # the whole process, model loading included
    else:
        peak = max(float(v.get("peak_memory_alloc", 0)) for v in later) * 1024**3
    shutil.rmtree(out, ignore_errors=True)  # the next round writes its own
    return {"tokens_per_s": tps, "peak": peak}


def logged_steps(log_dir: Path) -> list:
    """The metrics (name -> text) of every step after the first in a recipe's ``DiskLogger``
    logs (``Step N | name:value ...`` lines), by step; step 1 warms up."""
    logged = {}
    for log in sorted(log_dir.glob("log_*.txt")):
        for line in log.read_text().splitlines():
            m = re.match(r"Step (\d+) \| (.*)", line)
            if m:
                logged[int(m.group(1))] = dict(kv.split(":", 1) for kv in m.group(2).split())
    later = [v for step, v in sorted(logged.items()) if step > 1]
    if not later:
        raise RuntimeError(f"no step after the first is logged in {log_dir}")
    return later


# (label, recipe, sparse adapters?, SQUASH_NF4): torchtune's recipe computes its NF4 bases with
# torchao's linear_nf4 as torchtune's own modules do; squash's recipe with squash's NF4 kernel.
RECIPE_RUNS = (
    ("torchtune QLoRA", "lora_finetune_single_device", False, "torchao"),
    ("squash's QLoRA", "squash_finetune", False, "native"),
    ("squash, A+B", "squash_finetune", True, "native"),
)


def run_recipes(args, ckpt_dir: Path, work: Path) -> dict:
    """The recipe runs, one after the other, in ``args.recipe_rounds`` rounds (load from
    elsewhere then hits all alike): ``(label, recipe)`` -> list of runs."""
    runs = {run[:2]: [] for run in RECIPE_RUNS}
    for i in range(args.recipe_rounds):
        for run in RECIPE_RUNS:
            print(f"tune run {run[1]}, {run[0]} (round {i + 1}/{args.recipe_rounds})", flush=True)
            runs[run[:2]].append(run_recipe(args, ckpt_dir, work, run))
    return runs


def recipe_lines(runs: dict) -> list:
    """Table rows of the recipe runs (``(label, recipe)`` -> runs; the first is the baseline):
    tokens/s median [min-max] over the rounds, each run's tokens/s over the baseline's in the same
    round, the largest peak."""
    lines = []
    base = next(iter(runs.values()), None)
    for i, ((what, name), rs) in enumerate(runs.items()):
        tps = [r["tokens_per_s"] for r in rs]
        ratio = ""
        if i > 0:
            per = ", ".join(f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}" for r, b in zip(rs, base))
            ratio = f" ({per} of torchtune's, per round)"
        lines.append(
            f"| `tune run {name}` ({what}) | | | | {max(r['peak'] for r in rs) / 1024**2:.0f} "
            f"(whole process) | | | | {statistics.median(tps):.0f} [{min(tps):.0f}-{max(tps):.0f}]"
            f" (its log){ratio} | | |"
        )
    return lines


# ---- the table ------------------------------------------------------------------------------------
PEAK_CPU = "peak resident memory (VmHWM) during one step, model included, a fresh process a row"
PEAK_GPU = "max_memory_allocated during one step"


def table(args, timed, peaks, recipes) -> str:
    tokens = args.batch * args.seq_len
    base, base_peak = timed[0], peaks[0]["step_peak"]
    mib = 1024**2
    lines = [
        f"# Fine-tuning step: squash vs torchtune QLoRA ({time.strftime('%Y-%m-%d')})",
        "",
        f"{machine_line(args.device, DTYPES[args.dtype])}; {_isa(args.device)}",
        f"{_shapes_line(args)}; "
        f"{args.batch} x {args.seq_len} = {tokens} tokens a step; AdamW; step = forward + "
        f"backward + optimizer step, median of {args.steps} interleaved rounds (min-max in "
        f"brackets); peak = {PEAK_CPU if args.device == 'cpu' else PEAK_GPU}; "
        f"x = ratio to the first row; floor = the step's matmul FLOPs / this host's dense matmul "
        f"rate ({timed[0]['rate'] / 1e9:.2f} GFLOP/s, {args.batch * args.seq_len} x "
        f"{args.model['embed_dim']} x {4 * args.model['embed_dim']}, measured in this process).",
        "",
        "| row | adapter params | adapter+grad+AdamW MiB | x | peak MiB | x | step s | x | "
        "tokens/s | floor s | step / floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for t, p in zip(timed, peaks):
        m = t["memory"]
        lo, hi = t["step_spread"]
        lines.append(
            f"| {t['label']} | {m.trainable_params:,} | {m.total_bytes / mib:.1f} | "
            f"{m.total_bytes / base['memory'].total_bytes:.2f} | {p['step_peak'] / mib:.0f} | "
            f"{p['step_peak'] / base_peak:.2f} | {t['step_s']:.2f} [{lo:.2f}-{hi:.2f}] | "
            f"{t['step_s'] / base['step_s']:.2f} | {tokens / t['step_s']:.0f} | "
            f"{t['floor_s']:.4g} | {t['step_s'] / t['floor_s']:.2f} |"
        )
        if t["update_s"] is not None:
            lines.append(
                f"| ... its mask-update step | | | | {p['update_peak'] / mib:.0f} | "
                f"{p['update_peak'] / base_peak:.2f} ({p['update_peak'] / p['step_peak']:.2f} of "
                f"its normal step) | {t['update_s']:.2f} | {t['update_s'] / base['step_s']:.2f} | "
                f"{tokens / t['update_s']:.0f} | | |"
            )
    lines += recipe_lines(recipes)
    return "\n".join(lines + ["", *round_lines(timed), "", *host_lines(timed)]) + "\n"


def round_lines(timed) -> list:
    """Each row's step over the first row's in the same round (the rounds interleave the rows,
    so a slow spell of the host hits a round's rows alike); a mask-update step (None) is left
    out, as in the row's step column."""
    base = timed[0]["rounds"]
    lines = [f"Step over the first row's ({timed[0]['label']}), round by round:", ""]
    for t in timed[1:]:
        per = ", ".join(f"{s / b:.2f}" for s, b in zip(t["rounds"], base) if s is not None)
        lines.append(f"- {t['label']}: {per}")
    return lines


def host_lines(timed) -> list:
    """Each row's system CPU seconds and minor page faults (thousands), step by step in the order
    of the rounds (``getrusage`` around the step): a step the kernel slowed, taking memory back
    or serving other processes, shows there."""
    lines = ["System CPU s / minor page faults of each row's step, round by round:", ""]
    for t in timed:
        per = ", ".join(f"{s:.2f} s / {f / 1000:.0f}k" + (" (mask update)" if r is None else "")
                        for (f, s), r in zip(t["host"], t["rounds"]))  # fmt: skip
        lines.append(f"- {t['label']}: {per}")
    return lines


def _shapes_line(args) -> str:
    name, layers = FAMILIES[args.family]
    linears = "q, k, v, output, fc1, fc2" if args.family == "opt350m" else "q, k, v, output, w1, w2, w3"
    return f"{name} shapes, {args.layers} of {layers} layers, adapters on {linears}"


def _isa(device: str) -> str:
    return f"FFI kernels: {kernels(device)}".strip()


def write_results(out: Path, name: str, text: str, timed: list) -> None:
    """The table as ``name`` (markdown) in ``out``, its numbers beside it as JSON (each timed row
    with its rounds' step seconds, ``rounds_s``, a mask-update step ``null``) and the step-time
    picture as PNG (skipped, saying so, without matplotlib)."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / name
    md.write_text(text)
    results = finetune_plot.parse_markdown(text)
    rounds = {t["label"]: t["rounds"] for t in timed}
    for row in results["rows"]:
        row["rounds_s"] = rounds.get(row["label"])
    md.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    drawn = finetune_plot.write_png(results, md.with_suffix(".png")) is not None
    print(f"written to {md}, {md.stem}.json" + (f", {md.stem}.png" if drawn else ""))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plot"]:  # redraw a stored results file's picture
        return finetune_plot.main(argv[1:])
    args = parse_args(argv)
    if args.row is not None:
        print(json.dumps(peak_child(args, Path(args.checkpoint_dir), int(args.row))))
        return 0
    work = Path(tempfile.mkdtemp(prefix="squash-finetune-bench-"))
    try:
        if args.checkpoint_dir:
            ckpt_dir = Path(args.checkpoint_dir)
            hf = json.loads((ckpt_dir / "config.json").read_text())
            args.layers = hf["num_hidden_layers"]
            args.model["vocab_size"] = hf["vocab_size"]
        else:
            name = FAMILIES[args.family][0]
            print(f"writing a random {name}-shaped checkpoint ({args.layers} layers)", flush=True)
            ckpt_dir = write_random_checkpoint(args, work / "checkpoint")
        print("timing the rows", flush=True)
        timed = time_rows(args, ckpt_dir)
        print("measuring peak memory", flush=True)
        peaks = measure_peaks(args, ckpt_dir)
        recipes = {} if args.no_recipes else run_recipes(args, ckpt_dir, work)
        text = table(args, timed, peaks, recipes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    family = "" if args.family == "opt350m" else f"{args.family}_"
    name = f"finetune_{args.device.split(':')[0]}_{args.dtype}_{family}{args.layers}layers.md"
    write_results(Path(args.out), name, text, timed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
