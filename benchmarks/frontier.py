"""The quality-per-byte frontier on SmolLM2-135M-Instruct: test loss against adapter memory.

    python benchmarks/frontier.py work --threads 1      # one worker; start two side by side
    python benchmarks/frontier.py status                # what is done, running, next
    python benchmarks/frontier.py report                # tables + plots from the run files
    python benchmarks/frontier.py work --quick ...      # every stage on toy sizes

QLoRA at ranks 2 to 64, squash A+B 90% and squash A 90% at 1/8 to 2 times QLoRA r=16's adapter
memory, and full fine-tuning of the unquantized model, each at its own best learning rate
(``frontier_plan``), on the learning curves' tasks and schedule (``quality_curves``: 200 steps of
batch 8, every 25 steps the whole validation and test splits scored). Each point also records
what the fine-tune cost the model elsewhere (Biderman et al. 2024, "LoRA Learns Less and
Forgets Less"): its loss on general text it was not tuned on, 16 windows of 256 tokens of the
Python Language Reference's test split (``squash.datasets.pydoc_text``), split ``forget``.

Adapter arms run through the recipe class users run, exactly as the learning curves do
(``quality_curves.run_one``); full fine-tuning through :func:`run_full`, a plain loop over the
same data loader, schedule and clipping. Runs resume from their last point. The learning curves'
finished runs (``benchmarks/results/quality_curves/``) count for the sweeps of the three arms at
r=16's budget; the frontier's own runs go to ``benchmarks/results/frontier/<task>/``.
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from common import host  # noqa: E402
import regime_plan  # noqa: E402
from frontier_plan import arms, plan  # noqa: E402
from quality_curves import (  # noqa: E402
    EVAL_BATCH, IGNORE, RESULTS as CURVES, WORK as CURVES_WORK, BestState, Claim, _n_train,
    evaluate, load_split, score_point,
    run_one, write_json,
)
from quality_curves_plan import FULL, QUICK, TASKS, load_done, recipe_config, run_id  # noqa: E402

RESULTS = CURVES.with_name("frontier")
WORK = CURVES_WORK.with_name("frontier")
DEFAULT_CKPT = Path.home() / ".cache" / "squash" / "smollm2-135m-instruct"
FORGET_WINDOWS, FORGET_LEN = 16, 256


def is_candidate(task: str) -> bool:
    """Whether ``task`` is one of the regime search's candidates (``regime_plan``)."""
    return task in regime_plan.CANDIDATES


def task_size(task: str, quick: bool) -> dict:
    if is_candidate(task):
        return dict(regime_plan.QUICK_SIZE if quick else regime_plan.SIZE)
    return dict(QUICK if quick else FULL)


def task_arms(task: str, steps: int) -> dict:
    return regime_plan.arms(steps) if is_candidate(task) else arms(steps)


def task_plan(task: str):
    return regime_plan.plan if is_candidate(task) else plan


def text_split(task: str, tok, split: str, n: int) -> list:
    """``n`` windows of a text candidate's split, spread over it (scored on every token)."""
    from omegaconf import OmegaConf
    from torchtune import config

    t = TASKS[task]
    ds = config.instantiate(OmegaConf.create({"_component_": t["dataset"], **t.get("args", {})}),
                            tok, split=split, max_windows=n)  # fmt: skip
    return [dict(ds[i], required=0) for i in range(len(ds))]


def forget_split(tok, n: int = FORGET_WINDOWS) -> list:
    """The general-text windows every point is scored on (loss over every token)."""
    from squash.datasets.pydoc_text import PydocTextDataset

    ds = PydocTextDataset(tok, split="test", max_seq_len=FORGET_LEN, max_windows=n)
    return [dict(ds[i], required=0) for i in range(len(ds))]


# ---- full fine-tuning ---------------------------------------------------------------------------
def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def run_full(task: str, arm: dict, lr: float, seed: int, *, size: dict, ckpt: Path, out: Path,
             work: Path, data: dict) -> dict:  # fmt: skip
    """Full fine-tuning of the unquantized SmolLM2-135M-Instruct (every weight trainable, fp32):
    the recipe's data loader, AdamW without weight decay, cosine schedule with warmup, gradients
    clipped at 1.0, mean cross-entropy over answer tokens; a state file at every point to resume
    from. The record is the adapter runs' (``quality_curves.run_one``)."""
    from omegaconf import OmegaConf
    from torchtune import config, training
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    from squash.models.smollm2 import smollm2_135m, smollm2_tokenizer
    from squash.training.data import setup_dataloader, steps_per_epoch

    rid = run_id(arm["key"], lr, seed)
    run_dir = work / "runs" / task / rid
    state_file = run_dir / "state.pt"
    rec = json.loads(out.read_text()) if out.exists() else None
    if rec is None or not rec["points"] or not state_file.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        rec = dict(id=rid, task=task, arm=arm, lr=lr, seed=seed, frac=1.0, size=size,
                   n_train=_n_train(task), device="cpu", dtype="fp32", points=[], done=False,
                   sessions=[])  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    resume = bool(rec["points"])
    rec["sessions"].append(dict(machine=host(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                                resumed_at=rec["points"][-1]["step"] if resume else 0))  # fmt: skip
    cfg = OmegaConf.create(recipe_config(task, dict(rank=1, alpha=1.0), lr, seed, 1.0, run_dir,
                                         ckpt, size, rec["n_train"], "cpu", "fp32", False))  # fmt: skip
    training.set_seed(seed)  # no dropout in SmolLM2: the seed orders the data only
    tok = smollm2_tokenizer(str(ckpt), max_seq_len=TASKS[task]["max_seq_len"])
    with training.set_default_dtype(torch.float32):
        model = smollm2_135m()
    model.load_state_dict(config.instantiate(cfg.checkpointer).load_checkpoint()["model"])
    loader = setup_dataloader(cfg.dataset, tok, batch_size=size["batch"], shuffle=True, seed=seed,
                              ignore_index=IGNORE)  # fmt: skip
    per_epoch = steps_per_epoch(len(loader), batch_size=size["batch"], grad_accum=1,
                                max_steps_per_epoch=cfg.max_steps_per_epoch)  # fmt: skip
    total = cfg.epochs * per_epoch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, size["warmup"], total)
    step, epoch, in_epoch, loader_state = 0, 0, 0, None
    if resume:
        st = torch.load(state_file, weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step, epoch, in_epoch, loader_state = st["step"], st["epoch"], st["in_epoch"], st["loader"]
    t_start = time.perf_counter()
    losses = []

    best = BestState(model, run_dir / "best.pt", lambda n: n in dict(model.named_parameters()))

    def point(step):
        score_point(rec, out, best, step, lambda k, v: evaluate(
            model, v, pad_id=tok.pad_id, device="cpu", batch=EVAL_BATCH.get(k, 16)), data,
            size["steps"], losses, t_start, f"{task} {rid}")  # fmt: skip

    if not resume:
        point(0)
    model.train()
    for epoch in range(epoch, cfg.epochs):
        loader.sampler.set_epoch(epoch)
        if loader_state is not None:  # mid-epoch: the batches after the saved one
            loader.load_state_dict(loader_state)
            loader_state = None
        for batch in loader:
            labels = batch["labels"]  # (b, s): position t predicts labels[t + 1]
            labels = torch.hstack((labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)))
            logits = model(batch["tokens"])  # (b, s, vocab)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                     labels.reshape(-1), ignore_index=IGNORE)  # fmt: skip
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            step, in_epoch = step + 1, in_epoch + 1
            end = in_epoch >= per_epoch
            if step % size["eval_every"] == 0 or step == total:
                _save_state(state_file, dict(
                    model=model.state_dict(), optimizer=opt.state_dict(),
                    scheduler=sched.state_dict(), step=step,
                    epoch=epoch + 1 if end else epoch, in_epoch=0 if end else in_epoch,
                    loader=None if end else loader.state_dict()))  # fmt: skip
                point(step)
                model.train()
            if end:
                break
        in_epoch = 0
    rec["done"] = rec["points"][-1]["step"] == size["steps"]
    rec["sessions"][-1]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec["sessions"][-1]["seconds"] = time.perf_counter() - t_start
    write_json(out, rec)
    if rec["done"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rec


# ---- the queue ----------------------------------------------------------------------------------
def state(results: Path, curves: Path, task: str, size: dict, quick: bool) -> tuple:
    """``(done, mine, points, ref)`` for :func:`frontier_plan.plan`: the learning curves' and
    the frontier's finished runs, the frontier's alone, each finished arm's best-rate seed-0
    best-point test loss, and QLoRA r=16's (mean, std) over its seeds (None before 2 seeds).
    For a regime candidate ``ref`` is each arm's seeds' best-point test losses
    (``regime_plan.plan``'s ``seeds``)."""
    from frontier_report import best_point, groups

    mine = load_done(results / task, size["steps"])
    done = {**load_done(curves / task, size["steps"]), **mine}
    g = groups(done, size["steps"], task_arms(task, size["steps"]))
    points = {k: best_point(row["seeds"][0])["test"]["loss"] for k, row in g.items()
              if row["seeds"] and row["seeds"][0]["seed"] == 0}  # fmt: skip
    if is_candidate(task):
        seeds = {k: [best_point(r)["test"]["loss"] for r in row["seeds"]] for k, row in g.items()}
        return done, mine, points, seeds
    ref = None
    r16 = g.get("qlora_r16")
    if r16 is not None and len(r16["seeds"]) >= 2:
        import statistics

        losses = [best_point(r)["test"]["loss"] for r in r16["seeds"]]
        ref = (statistics.fmean(losses), statistics.stdev(losses))
    return done, mine, points, ref


def queue(task: str, results: Path, curves: Path, quick: bool) -> list:
    """``task``'s runs still to do, stage by stage, each in its plan's order."""
    size = task_size(task, quick)
    return sorted(task_plan(task)(task, *state(results, curves, task, size, quick), size["steps"],
                                  quick=quick), key=lambda q: q[0])  # fmt: skip


def work_loop(args) -> None:
    tasks = args.tasks.split(",")
    results, curves, work = _dirs(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    import logging

    import squash_finetune  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torchtune", "squash")):
            logging.getLogger(name).setLevel(logging.WARNING)
    from squash.models.smollm2 import smollm2_tokenizer

    ckpt = Path(args.checkpoint_dir or DEFAULT_CKPT)
    cache, ran = {}, 0
    while args.max_runs is None or ran < args.max_runs:
        todo = None
        # every task's queue together, stage by stage, tasks in the order given
        every = sorted(((q[0], i, task, *q[1:]) for i, task in enumerate(tasks)
                        for q in queue(task, results, curves, args.quick)), key=lambda q: q[:2])  # fmt: skip
        for _, _, task, rid, key, lr, seed in every:
            try:
                claim = Claim(work, f"{task}_{rid}")
            except OSError:
                continue
            todo = (task, rid, key, lr, seed, claim)
            break
        if todo is None:
            print("nothing left to run (or everything left is claimed)", flush=True)
            return
        task, rid, key, lr, seed, claim = todo
        size = task_size(task, args.quick)
        try:
            if task not in cache:
                tok = smollm2_tokenizer(str(ckpt), max_seq_len=TASKS[task]["max_seq_len"])
                split = text_split if is_candidate(task) else load_split
                data = {"val": split(task, tok, "validation", size["n_val"]),
                        "test": split(task, tok, "test", size["n_test"]),
                        "forget": forget_split(tok, 2 if args.quick else FORGET_WINDOWS)}  # fmt: skip
                cache[task] = (data, n_train_of(task, tok))
            data, n_train = cache[task]
            arm = task_arms(task, size["steps"])[key]
            print(f"[{task} {rid}] starting ({arm['name']}, lr {lr:.0e}, seed {seed})", flush=True)
            out = results / task / f"{rid}.json"
            if arm.get("full"):
                run_full(task, arm, lr, seed, size=size, ckpt=ckpt, out=out, work=work, data=data)
            else:
                run_one(task, arm, lr, seed, 1.0, size=size, ckpt=ckpt, out=out, work=work,
                        data=data, n_train=n_train, device="cpu", dtype="fp32")  # fmt: skip
        finally:
            claim.release()
        ran += 1


def n_train_of(task: str, tok) -> int:
    """Training samples (windows, for a text candidate) of ``task``."""
    if not is_candidate(task):
        return _n_train(task)
    from omegaconf import OmegaConf
    from torchtune import config

    t = TASKS[task]
    return len(config.instantiate(OmegaConf.create({"_component_": t["dataset"],
                                                    **t.get("args", {})}), tok, split="train"))  # fmt: skip


def _dirs(args) -> tuple:
    quick = "_quick" if args.quick else ""
    results = args.results or RESULTS.with_name("frontier" + quick)
    curves = args.curves or CURVES.with_name("quality_curves" + quick)
    work = args.work or WORK.with_name("frontier" + quick)
    return results, curves, work


def status(args) -> str:
    results, curves, work = _dirs(args)
    out = []
    for task in args.tasks.split(","):
        mine = load_done(results / task, task_size(task, args.quick)["steps"])
        todo = queue(task, results, curves, args.quick)
        running = []
        for q in todo:
            try:
                Claim(work, f"{task}_{q[1]}").release()
            except OSError:
                running.append(q[1])
        waiting = [q[1] for q in todo if q[1] not in running]
        out.append(f"{task}: {len(mine)} frontier runs done; running: "
                   f"{', '.join(running) or 'none'}; queued now: {len(waiting)}"
                   + (f" (next {', '.join(waiting[:4])})" if waiting else ""))  # fmt: skip
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["work", "status", "report"])
    p.add_argument("--tasks", default="unicode", help="comma-separated, in priority order")
    p.add_argument("--quick", action="store_true", help="toy sizes: every stage in minutes")
    p.add_argument("--checkpoint-dir", default=None, help="squash download's output directory")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--curves", type=Path, default=None,
                   help="the learning curves' results (their sweeps count here)")
    p.add_argument("--work", type=Path, default=None, help="claims and run checkpoints")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-runs", type=int, default=None)
    p.add_argument("--png-dir", type=Path, default=None,
                   help="report: also copy each task's PNG here as frontier_<task>.png")
    args = p.parse_args(argv)
    if args.command == "work":
        return work_loop(args)
    if args.command == "status":
        return print(status(args))
    from frontier_report import report

    size = dict(QUICK if args.quick else FULL)
    results, curves, _ = _dirs(args)
    text = report(results, curves, args.tasks.split(","), size, args.png_dir)
    tmp = results / "README.md.tmp"
    tmp.write_text(text)
    tmp.replace(results / "README.md")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
