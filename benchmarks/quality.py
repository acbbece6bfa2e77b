"""Quality at equal memory: QLoRA against squash on a task that needs real learning.

    python benchmarks/quality.py            # the full run (README: "Quality at equal memory")
    python benchmarks/quality.py --quick    # a smoke run of every stage, for the tests
    python benchmarks/quality.py --model smollm2 ...  # SmolLM2-135M: benchmarks/quality_smollm2.py
                                                      # (--model anywhere; the rest its options)

The task (generated, deterministic for ``--data-seed``): sequences of 3-6 letters from a
16-letter alphabet. A small OPT is first pre-trained here (full fine-tune, plain PyTorch) on two
skills, ``rev: x`` -> reversed ``x`` and ``copy: x`` -> ``x``, so the base knows something. The
fine-tuning task is ``code: x`` -> reversed ``sigma(x)`` for a secret letter permutation
``sigma`` the base never saw: a mapping it does not know composed with a skill it does. Train,
validation and test inputs are disjoint.

Every arm is fine-tuned through the recipe's own code path (``SquashFinetuneRecipeSingleDevice``
in this process, a config built in code, the pre-trained base written in HF format for
``OPTCheckpointer``, the data as local JSON for torchtune's ``instruct_dataset``); then held-out
loss (mean cross-entropy per answer token, EOS included) and exact-match accuracy (every answer
token, EOS included, is the argmax under teacher forcing, which is what greedy decoding returns)
are measured on the adapted model.

Arms: QLoRA rank r (torchtune's ``LoRALinear`` on NF4); squash rank r (A 90% sparse); squash at
the largest rank whose adapter+grad+AdamW+index bytes fit in QLoRA rank r's
(``max_rank_within``), both factors 90% sparse and A only; the both-factor one with dynamic masks
(``mask_update``) and with the SVD init; QLoRA (dense adapters) at the both-factor squash rank,
what that rank costs when dense. Each arm's learning rate is picked on the validation split from a
log grid, widened while the best is at an edge; then ``--seeds`` seeds per arm on the test split
at that rate (seed 0 is the sweep's run). Mean and sample standard deviation over seeds.

Writes ``benchmarks/results/quality.md`` (``quality_quick.md`` with ``--quick``) and the same
numbers, per seed and per learning rate, as ``.json`` beside it.
"""

import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the recipe's progress bar, once per run

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torchtune.data import padded_collate_sft  # noqa: E402
from torchtune.datasets import instruct_dataset  # noqa: E402

from squash.models.opt import opt, opt_tokenizer, opt_tune_to_hf  # noqa: E402
from squash.training import lora_adapter_memory, max_rank_within  # noqa: E402
from squash.training.heldout import token_loss  # noqa: E402

from common import arm_row, host, mean_std, model_script, recipe_training  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets" / "tiny_opt"
RESULTS = ROOT / "benchmarks" / "results"
IGNORE = -100
MODELS = {  # --model: (the script that runs it, None for this one; help)
    "opt_2layer": (None, "the generated task on a 2-layer OPT (default)"),
    "smollm2": ("quality_smollm2", "SmolLM2-135M-Instruct (benchmarks/quality_smollm2.py, its own "
                "options)"),
}
LETTERS = list("abcdfghklmnoprst")  # each " x" and "x" is one token of the tiny tokenizer
ATTN = ["q_proj", "k_proj", "v_proj", "output_proj"]

# A pre-norm OPT with the shipped tiny tokenizer's vocabulary; every adapted weight has a
# multiple of 16384 elements, so torchao's NF4 takes it.
MODEL = dict(vocab_size=1024, num_layers=2, num_heads=4, embed_dim=128, intermediate_dim=256,
             max_seq_len=64, word_embed_proj_dim=128, pre_norm=True)  # fmt: skip
HF_CONFIG = dict(
    model_type="opt", architectures=["OPTForCausalLM"], activation_function="relu",
    vocab_size=MODEL["vocab_size"], hidden_size=MODEL["embed_dim"],
    num_hidden_layers=MODEL["num_layers"], num_attention_heads=MODEL["num_heads"],
    ffn_dim=MODEL["intermediate_dim"], max_position_embeddings=MODEL["max_seq_len"],
    word_embed_proj_dim=MODEL["embed_dim"], do_layer_norm_before=True, enable_bias=True,
    layer_norm_elementwise_affine=True, _remove_final_layer_norm=False, dropout=0.0,
    attention_dropout=0.0, init_std=0.02, pad_token_id=1, bos_token_id=2, eos_token_id=2,
    tie_word_embeddings=True, torch_dtype="float32",
)  # fmt: skip

FULL = dict(pretrain_steps=500, pretrain_batch=64, steps=150, batch=32, n_val=256, n_test=512,
            grid=[10 ** e for e in (-3.0, -2.5, -2.0, -1.5, -1.0)], max_widen=3, seeds=5)
# --quick: every stage on toy sizes (a 2-point grid, so the widening always runs once).
QUICK = dict(pretrain_steps=30, pretrain_batch=16, steps=4, batch=8, n_val=16, n_test=24,
             grid=[10 ** e for e in (-3.0, -2.0)], max_widen=1, seeds=2)  # fmt: skip
ARM_KEYS = ["qlora", "squash_r", "squash_both", "squash_a", "squash_both_mask",
            "squash_both_svd", "qlora_dense_at_squash_rank"]  # fmt: skip


# ---- data -----------------------------------------------------------------------------------
def make_sigma(seed: int) -> dict:
    """The secret letter permutation of the fine-tuning task."""
    rng = random.Random(seed)
    perm = LETTERS[:]
    rng.shuffle(perm)
    return dict(zip(LETTERS, perm))


def answer(task: str, letters: list, sigma: dict) -> list:
    if task == "copy":
        return letters
    if task == "rev":
        return letters[::-1]
    if task == "code":
        return [sigma[c] for c in letters][::-1]
    raise ValueError(task)


def record(task: str, letters: list, sigma: dict) -> dict:
    return {"input": f"{task}: " + " ".join(letters), "output": " ".join(answer(task, letters, sigma))}


def make_splits(seed: int, n_train: int, n_val: int, n_test: int) -> dict:
    """Disjoint letter sequences for pre-training, fine-tuning train/val/test."""
    rng = random.Random(seed)
    seen, out = set(), {}
    for name, n in (("val", n_val), ("test", n_test), ("train", n_train)):
        items = []
        while len(items) < n:
            seq = tuple(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
            if seq in seen and name != "train":
                continue
            if name != "train":
                seen.add(seq)
            elif seq in seen:
                continue
            items.append(list(seq))
        out[name] = items
    return out


def write_json(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records))
    return path


# ---- model and evaluation -------------------------------------------------------------------
def tokenizer():
    return opt_tokenizer(str(ASSETS / "vocab.json"), str(ASSETS / "merges.txt"), max_seq_len=64)


def load_split(path: Path, tok) -> list:
    ds = instruct_dataset(tok, source="json", data_files=str(path), split="train")
    return [ds[i] for i in range(len(ds))]


def batches(samples: list, size: int):
    for i in range(0, len(samples), size):
        yield padded_collate_sft(samples[i : i + size], padding_idx=1, ignore_idx=IGNORE)


def shift(labels: torch.Tensor) -> torch.Tensor:
    """Labels of the next token at each position, as the recipe shifts them."""
    pad = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat((labels[:, 1:], pad), dim=1)


def score_logits(logits: torch.Tensor, labels: torch.Tensor) -> tuple:
    """``(summed cross-entropy, answer tokens, exact matches, examples)`` of one batch.

    Args:
        logits (torch.Tensor): ``(b, s, vocab)``.
        labels (torch.Tensor): ``(b, s)``, next-token targets, ``IGNORE`` off the answer.
    """
    mask = labels != IGNORE
    ce, _ = token_loss(logits, labels, IGNORE)  # squash's held-out loss
    hit = (logits.argmax(-1) == labels) | ~mask  # (b, s)
    return float(ce), int(mask.sum()), int(hit.all(-1).sum()), labels.shape[0]


@torch.no_grad()
def evaluate(model, samples: list) -> dict:
    model.eval()
    ce = tokens = exact = n = 0
    for batch in batches(samples, 512):
        logits = model(batch["tokens"])
        if isinstance(logits, list):
            logits = torch.cat(logits, dim=1)
        c, t, e, b = score_logits(logits, shift(batch["labels"]))
        ce, tokens, exact, n = ce + c, tokens + t, exact + e, n + b
    model.train()
    return {"loss": ce / tokens, "exact_match": exact / n}


def pretrain(samples: list, steps: int, batch: int, seed: int) -> torch.nn.Module:
    """Full fine-tune of a fresh OPT on the base skills (plain PyTorch, loss on answers only)."""
    torch.manual_seed(seed)
    model = opt(**MODEL)
    opt_ = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt_, max_lr=3e-3, total_steps=steps,
                                                pct_start=0.1)  # fmt: skip
    rng = random.Random(seed)
    for _ in range(steps):
        b = padded_collate_sft(rng.sample(samples, batch), padding_idx=1, ignore_idx=IGNORE)
        logits = model(b["tokens"])
        loss = F.cross_entropy(logits.transpose(1, 2), shift(b["labels"]), ignore_index=IGNORE)
        opt_.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt_.step()
        sched.step()
    return model.eval()


def write_hf_base(model: torch.nn.Module, out: Path) -> None:
    """The pre-trained base as an HF OPT checkpoint that ``OPTCheckpointer`` reads."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in opt_tune_to_hf(model.state_dict()).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(HF_CONFIG, indent=2))


# ---- arms -----------------------------------------------------------------------------------
def adapted_shapes() -> list:
    """``(in, out)`` of every adapted linear: q, k, v, output projections and fc1, fc2."""
    d, f = MODEL["embed_dim"], MODEL["intermediate_dim"]
    return ([(d, d)] * len(ATTN) + [(d, f), (f, d)]) * MODEL["num_layers"]


def arms(rank: int, sparsity: float) -> list:
    """Each arm: name and its model/mask settings; ranks from the memory accounting (fp32)."""
    shapes = adapted_shapes()
    budget = lora_adapter_memory(shapes, rank, dtype=torch.float32).total_bytes
    r_both = max_rank_within(budget, shapes, sparsity=sparsity, sparse_factor="both",
                             dtype=torch.float32)  # fmt: skip
    r_a = max_rank_within(budget, shapes, sparsity=sparsity, sparse_factor="a",
                          dtype=torch.float32)  # fmt: skip
    sp = f"{sparsity:.0%}"
    mask = {"every_n_steps": 10, "drop_fraction": 0.3}
    out = [
        dict(name=f"QLoRA r={rank}", rank=rank, sparsity=None, factor="a"),
        dict(name=f"squash r={rank}, A {sp}", rank=rank, sparsity=sparsity, factor="a"),
        dict(name=f"squash r={r_both}, A+B {sp} (equal memory)", rank=r_both, sparsity=sparsity,
             factor="both"),
        dict(name=f"squash r={r_a}, A {sp} (equal memory)", rank=r_a, sparsity=sparsity,
             factor="a"),
        dict(name=f"squash r={r_both}, A+B {sp}, dynamic mask", rank=r_both, sparsity=sparsity,
             factor="both", mask_update=mask),
        dict(name=f"squash r={r_both}, A+B {sp}, SVD init", rank=r_both, sparsity=sparsity,
             factor="both", init="svd"),
        dict(name=f"QLoRA r={r_both} (dense at squash's rank)", rank=r_both, sparsity=None,
             factor="a"),
    ]  # fmt: skip
    for arm in out:
        mem = lora_adapter_memory(shapes, arm["rank"], sparsity=arm["sparsity"],
                                  sparse_factor=arm["factor"], dtype=torch.float32)  # fmt: skip
        arm["adapter_bytes"] = mem.total_bytes
        arm["vs_budget"] = mem.total_bytes / budget
    return out


def recipe_config(arm: dict, lr: float, seed: int, run_dir: Path, base_dir: Path,
                  train_json: Path, steps: int, batch: int) -> dict:  # fmt: skip
    model = dict(_component_="squash.models.opt.lora_opt", lora_attn_modules=ATTN,
                 apply_lora_to_mlp=True, lora_rank=arm["rank"], lora_alpha=2 * arm["rank"],
                 quantize_base=True, sparsity=arm["sparsity"], sparse_factor=arm["factor"],
                 **MODEL)  # fmt: skip
    if arm.get("init"):
        model["init"] = arm["init"]
    cfg = dict(
        output_dir=str(run_dir),
        model=model,
        tokenizer=dict(_component_="squash.models.opt.opt_tokenizer",
                       vocab_path=str(ASSETS / "vocab.json"),
                       merges_path=str(ASSETS / "merges.txt"), max_seq_len=64),
        checkpointer=dict(_component_="squash.models.opt.OPTCheckpointer",
                          checkpoint_dir=str(base_dir), checkpoint_files=["model.safetensors"],
                          output_dir=str(run_dir)),
        resume_from_checkpoint=False,
        save_adapter_weights_only=True,
        dataset=dict(_component_="torchtune.datasets.instruct_dataset", source="json",
                     data_files=str(train_json), split="train"),
        seed=seed, shuffle=True, batch_size=batch,
        **recipe_training(arm, lr, steps, run_dir, device="cpu", dtype="fp32", log_every=1000),
    )  # fmt: skip
    return cfg


def finetune(cfg: dict, splits: dict) -> dict:
    """One run of the recipe's code path, then held-out metrics on ``splits``."""
    from squash_finetune import SquashFinetuneRecipeSingleDevice

    conf = OmegaConf.create(cfg)
    recipe = SquashFinetuneRecipeSingleDevice(cfg=conf)
    try:
        recipe.setup(cfg=conf)
        recipe.train()
        return {name: evaluate(recipe._model, samples) for name, samples in splits.items()}
    finally:
        recipe.cleanup()
        shutil.rmtree(cfg["output_dir"], ignore_errors=True)


def sweep(arm: dict, grid: list, max_widen: int, run) -> tuple:
    """Validation loss per lr; widen the log grid by one step past an edge that holds the best."""
    results = {}
    for lr in grid:
        if _lr(lr) not in results:  # a grid of one lr twice: one run, scored on validation too
            results[_lr(lr)] = run(arm, _lr(lr), 0)
    ratio = grid[1] / grid[0]
    widened = 0
    while widened < max_widen:
        lrs = sorted(results)
        best = min(lrs, key=lambda lr: results[lr]["val"]["loss"])
        if best == lrs[0]:
            new = lrs[0] / ratio
        elif best == lrs[-1]:
            new = lrs[-1] * ratio
        else:
            break
        results[_lr(new)] = run(arm, _lr(new), 0)
        widened += 1
    lrs = sorted(results)
    best = min(lrs, key=lambda lr: results[lr]["val"]["loss"])
    at_edge = best in (lrs[0], lrs[-1])
    return results, best, at_edge


def _lr(lr: float) -> float:
    """The learning rate as the tables and the json write it (6 significant digits)."""
    return float(f"{lr:.6g}")


# ---- the table ------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    lines = [
        f"Task: `code: x` -> reversed sigma(x), letters from a {len(LETTERS)}-letter alphabet, "
        f"3-6 per sequence; {res['n_train']} train, {res['n_val']} validation, "
        f"{res['n_test']} test examples.",
        f"Base: OPT (pre-norm, {MODEL['num_layers']} layers, hidden {MODEL['embed_dim']}, MLP "
        f"{MODEL['intermediate_dim']}) pre-trained {res['pretrain_steps']} steps on `rev:`/`copy:`"
        f"; held-out `rev:` exact match {res['base']['rev']['exact_match']:.3f}, and on the test "
        f"task before fine-tuning loss {res['base']['code']['loss']:.3f}, exact match "
        f"{res['base']['code']['exact_match']:.3f}. Reference predictors on the test split: "
        f"reversal without the mapping {res['reference']['reverse_only']:.3f} exact match, "
        f"the true answers {res['reference']['oracle']:.3f}.",
        f"Fine-tuning: the recipe (`SquashFinetuneRecipeSingleDevice`), NF4 base, adapters on "
        f"q/k/v/output and fc1/fc2, alpha = 2 x rank, AdamW, cosine schedule, {res['steps']} "
        f"steps of batch {res['batch']}, fp32. Memory: adapter params+grads+AdamW+FFI indices "
        f"(fp32), as `lora_adapter_memory` counts them. lr picked per arm by validation loss; "
        f"test: {res['seeds']} seeds at that lr (mean +/- sample std).",
        f"Machine: {res['machine']}; wall time {res['wall_s']:.0f} s.",
        "",
        "| arm | rank | adapter memory vs QLoRA r | lr sweep: validation loss (exact match) | "
        "best lr | test loss | test exact match | seeds (test loss) |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for a in res["arms"]:
        lines.append(arm_row(a, ".1e", " (edge)" if a["best_at_edge"] else ""))
    lines += ["", res["verdict"]]
    return "\n".join(lines) + "\n"


def verdict(res: dict) -> str:
    by = {a["key"]: a for a in res["arms"]}
    q = by["qlora"]
    out = []
    for key, label in (("squash_both", "both factors 90% sparse"), ("squash_a", "A only")):
        if key not in by:
            continue
        s = by[key]
        diff = q["test_loss_mean"] - s["test_loss_mean"]
        spread = max(q["test_loss_std"], s["test_loss_std"])
        won = "beat" if diff > 0 else "did not beat"
        rel = f"{abs(diff) / spread:.1f}x the larger seed std ({spread:.2g})" if spread > 0 else (
            "seed std 0")
        out.append(
            f"Squash at equal memory ({label}, rank {s['rank']}) {won} QLoRA rank {q['rank']} "
            f"(at QLoRA's best lr {q['best_lr']:.1e}) on held-out test loss: "
            f"{s['test_loss_mean']:.3f} against {q['test_loss_mean']:.3f}, a difference of "
            f"{abs(diff):.3f}, {rel}."
        )
    best = min(res["arms"], key=lambda a: a["test_loss_mean"])
    out.append(f"Lowest test loss: {best['name']} ({best['test_loss_mean']:.3f}).")
    return " ".join(out)


def main(argv=None) -> dict:
    smollm2, p = model_script(argv, __doc__, MODELS)
    if smollm2 is not None:  # the real model: benchmarks/quality_smollm2.py
        return smollm2()
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every stage")
    p.add_argument("--rank", type=int, default=8, help="QLoRA's rank r (default 8)")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--seeds", type=int, default=None, help="test seeds per arm (default 5)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--arms", default=",".join(ARM_KEYS), help="comma-separated arm keys")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; these tensors are tiny, more threads mostly contend")
    p.add_argument("--out", type=Path, default=None, help="markdown path (json beside it)")
    args = p.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    if args.seeds is not None:
        size["seeds"] = args.seeds
    out_md = args.out or RESULTS / ("quality_quick.md" if args.quick else "quality.md")
    logging.getLogger("torchtune").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    import squash_finetune  # noqa: F401  (its logger is set to INFO on import)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torchtune") or name.startswith("squash"):
            logging.getLogger(name).setLevel(logging.WARNING)
    chosen = args.arms.split(",")
    unknown = [k for k in chosen if k not in ARM_KEYS]
    if unknown or "qlora" not in chosen:
        p.error(f"--arms must include qlora and name only {ARM_KEYS}, got {args.arms}")
    t0 = time.perf_counter()
    torch.manual_seed(args.data_seed)

    sigma = make_sigma(args.data_seed + 1)
    n_train = size["steps"] * size["batch"]
    splits = make_splits(args.data_seed, n_train, size["n_val"], size["n_test"])
    pre_rng = random.Random(args.data_seed + 2)
    pre_seqs = make_splits(args.data_seed + 3, size["pretrain_steps"] * 4, 0, 0)["train"]
    held = {tuple(s) for k in ("val", "test") for s in splits[k]}
    pre_seqs = [s for s in pre_seqs if tuple(s) not in held]

    work = Path(tempfile.mkdtemp(prefix="squash_quality_"))
    try:
        tok = tokenizer()
        files = {
            "pretrain": [record(pre_rng.choice(("rev", "copy")), s, sigma) for s in pre_seqs],
            "pre_rev": [record("rev", s, sigma) for s in splits["val"]],
            "train": [record("code", s, sigma) for s in splits["train"]],
            "val": [record("code", s, sigma) for s in splits["val"]],
            "test": [record("code", s, sigma) for s in splits["test"]],
        }
        paths = {k: write_json(work / f"{k}.json", v) for k, v in files.items()}
        data = {k: load_split(paths[k], tok) for k in ("pretrain", "pre_rev", "val", "test")}
        print(f"pre-training {size['pretrain_steps']} steps ...", flush=True)
        base = pretrain(data["pretrain"], size["pretrain_steps"], size["pretrain_batch"], 0)
        base_eval = {"rev": evaluate(base, data["pre_rev"]), "code": evaluate(base, data["test"])}
        print(f"base: {base_eval}", flush=True)
        base_dir = work / "base"
        write_hf_base(base, base_dir)
        reference = reference_predictors(files["test"], data["test"], tok)

        def run(arm, lr, seed):
            run_dir = work / f"run_{arm['key']}_{lr:.3e}_{seed}"
            cfg = recipe_config(arm, lr, seed, run_dir, base_dir, paths["train"],
                                size["steps"], size["batch"])  # fmt: skip
            t = time.perf_counter()
            evalsets = {"val": data["val"], "test": data["test"]} if seed == 0 else {
                "test": data["test"]}
            r = finetune(cfg, evalsets)
            print(f"  {arm['name']} lr={lr:.1e} seed={seed}: "
                  + ", ".join(f"{k} {v['loss']:.3f}/{v['exact_match']:.2f}" for k, v in r.items())
                  + f" ({time.perf_counter() - t:.1f} s)", flush=True)  # fmt: skip
            return r

        results = []
        for key, arm in zip(ARM_KEYS, arms(args.rank, args.sparsity)):
            arm["key"] = key
            if key not in chosen:
                continue
            sw, best, at_edge = sweep(arm, size["grid"], size["max_widen"], run)
            test = [sw[best]["test"]] + [run(arm, best, s)["test"] for s in range(1, size["seeds"])]
            loss_m, loss_s = mean_std([t["loss"] for t in test])
            em_m, em_s = mean_std([t["exact_match"] for t in test])
            results.append(dict(
                arm, sweep={f"{lr:.6g}": r for lr, r in sw.items()}, best_lr=best,
                best_at_edge=at_edge, test_loss=[t["loss"] for t in test],
                test_em=[t["exact_match"] for t in test], test_loss_mean=loss_m,
                test_loss_std=loss_s, test_em_mean=em_m, test_em_std=em_s,
            ))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)

    res = dict(
        quick=args.quick, rank=args.rank, sparsity=args.sparsity, seeds=size["seeds"],
        steps=size["steps"], batch=size["batch"], pretrain_steps=size["pretrain_steps"],
        n_train=n_train, n_val=size["n_val"], n_test=size["n_test"], sigma=sigma,
        shapes=adapted_shapes(), base=base_eval, reference=reference, arms=results,
        test_records=files["test"], machine=host(),
    )  # fmt: skip
    res["wall_s"] = time.perf_counter() - t0
    res["verdict"] = verdict(res)
    table = markdown(res)
    print(table)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(table)
    out_md.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print(f"Wrote {out_md} and {out_md.with_suffix('.json')}")
    return res


def reference_predictors(records: list, samples: list, tok) -> dict:
    """Exact match, through :func:`score_logits`, of two predictors whose answers are known: the
    true answers, and reversal without the mapping (one-hot logits of their answer tokens)."""
    out = {}
    for name, make in (("oracle", lambda r: r["output"]),
                       ("reverse_only", lambda r: " ".join(r["input"].split()[1:][::-1]))):  # fmt: skip
        hits = 0
        for r, s in zip(records, samples):
            pred = tok.encode(make(r), add_bos=False, add_eos=True)
            labels = shift(torch.tensor([s["labels"]]))
            pos = (labels[0] != IGNORE).nonzero().flatten()
            logits = torch.zeros(1, labels.shape[1], tok.vocab_size)
            if len(pred) == len(pos):
                logits[0, pos, torch.tensor(pred)] = 1.0
            hits += score_logits(logits, labels)[2]
        out[name] = hits / len(records)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
