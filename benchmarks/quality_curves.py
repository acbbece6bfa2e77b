"""Learning curves at equal memory on SmolLM2-135M-Instruct: QLoRA against squash, at length.

    python benchmarks/quality_curves.py work --threads 1     # one worker; start two side by side
    python benchmarks/quality_curves.py status               # what is done, running, next
    python benchmarks/quality_curves.py report               # tables + plots from the run files
    python benchmarks/quality_curves.py work --quick ...     # every stage on toy sizes

Every run fine-tunes through the recipe class users run (``SquashFinetuneRecipeSingleDevice``,
a config built in code, the NF4 base from ``squash download smollm2-135m-instruct``) for
:data:`FULL` ``steps`` steps of batch 8 with a cosine schedule, and scores the adapted model on the
whole validation and test splits before the first step and every ``eval_every`` steps: held-out
loss per answer token and the task metric (greedy exact match, computed under teacher forcing).
The points are taken right after the recipe's own step checkpoint is written, so a killed run
resumes from its last point through the recipe's exact resume (``resume_from_checkpoint``).

Two tasks of different kinds (``--task``):

- ``unicode``: name a Unicode character (``squash.datasets.unicode_names_dataset``); metric: the
  whole name and its stop token.
- ``pydocs``: explain a standard-library API in its docstring's prose
  (``squash.datasets.python_docs_dataset``, two to four sentences, splits disjoint by package);
  metric: the answer's first sentence.

Work is a queue of runs (``quality_curves_plan.plan``): each arm's learning rate swept on
validation at the full length (widened while the best is at an edge), then more seeds at the best
rate, then a quarter of the training data, then single-seed lever rows. Any number of workers
share it: a run is claimed by a lock held on an open file, each run writes its own json under
``benchmarks/results/quality_curves/<task>/`` after every point, and ``report``
(``quality_curves_report.py``) reads them all.
"""

import argparse
import fcntl
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft  # noqa: E402

from squash.training.heldout import next_token_loss  # noqa: E402

from common import host  # noqa: E402
from quality_curves_plan import (  # noqa: E402
    FULL, QUICK, ROOT, TASKS, arms, load_done, load_records, plan, recipe_config, run_id,
)
from quality_curves_report import report  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "quality_curves"
WORK = Path.home() / ".cache" / "squash" / "quality_curves"
DEFAULT_CKPT = Path.home() / ".cache" / "squash" / "smollm2-135m-instruct"
IGNORE = CROSS_ENTROPY_IGNORE_IDX
# samples per forward of the evaluation, by split (16 unless named): the frontier's general-text
# windows (``forget``) are 256 tokens each
EVAL_BATCH = {"forget": 4}
# splits scored at step 0 and then once, at the end, on the state of the best validation point
# (:class:`BestState`), not at every point
LATE = ("forget",)


class BestState:
    """The trainable state of a run's best validation point so far (lowest validation loss
    after step 0, the earliest of equals), kept in memory and in ``path`` so that a resumed run
    still has it; at the end the :data:`LATE` splits are scored on it.

    Args:
        model: the model trained.
        path (Path): where the state is kept between sessions.
        names (Callable[[str], bool]): which parameters and buffers are the trainable state
            (an adapter's ``.lora_`` tensors, FFI indices included; every parameter of a full
            fine-tune).
    """

    def __init__(self, model, path: Path, names):
        self.model, self.path = model, path
        self.tensors = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]
                        if names(n)}  # fmt: skip
        self.step, self.val, self.state = None, None, None
        if path.exists():
            saved = torch.load(path, weights_only=True)
            self.step, self.val, self.state = saved["step"], saved["val"], saved["state"]

    def consider(self, step: int, val: float) -> None:
        """Keep the state at ``step`` if its validation loss ``val`` is the lowest yet."""
        if step == 0 or (self.val is not None and val >= self.val):
            return
        self.step, self.val = step, val
        self.state = {n: t.detach().clone() for n, t in self.tensors.items()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(dict(step=step, val=val, state=self.state), tmp)
        tmp.replace(self.path)

    @torch.no_grad()
    def score(self, fn) -> dict:
        """``{"step": best step, **fn()}`` with the best state loaded into the model (the
        current state put back afterwards)."""
        now = {n: t.detach().clone() for n, t in self.tensors.items()}
        for n, t in self.tensors.items():
            t.copy_(self.state[n])
        try:
            return dict(step=self.step, **fn())
        finally:
            for n, t in self.tensors.items():
                t.copy_(now[n])


class Claim:
    """A run claimed by an exclusive ``flock`` on ``<work>/claims/<id>.lock``: released when
    this process exits, however it exits."""

    def __init__(self, work: Path, rid: str):
        (work / "claims").mkdir(parents=True, exist_ok=True)
        self._f = open(work / "claims" / f"{rid}.lock", "a")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.close()
            raise
        self._f.truncate(0)
        self._f.write(f"{os.getpid()}\n")
        self._f.flush()

    def release(self) -> None:
        self._f.close()


# ---- scoring ------------------------------------------------------------------------------------
def required_tokens(task: str, sample: dict, answer: str, tok) -> int:
    """How many answer tokens (from the first) the task metric needs right: for ``unicode``
    every answer token up to and including the first stop token; for ``pydocs`` the tokens of
    the answer's first sentence (and the turn's header before them), found at the answer's
    start (checked)."""
    targets = [t for t in sample["labels"] if t != IGNORE]
    if task == "unicode":
        stops = set(tok.stop_tokens)
        return next(i + 1 for i, t in enumerate(targets) if t in stops)
    from squash.datasets.python_docs import first_sentence

    ids = tok.encode(first_sentence(answer), add_bos=False, add_eos=False)
    # the assistant turn's header (``<|im_start|>assistant\n``) comes first in the labels
    for start in range(min(8, len(targets))):
        if targets[start : start + len(ids)] == ids:
            return start + len(ids)
    raise ValueError(f"the first sentence's tokens do not open the answer's: {answer!r}")


def load_split(task: str, tok, split: str, n: int) -> list:
    """The first ``n`` samples of a split with the number of metric tokens of each."""
    from torchtune import config

    ds = config.instantiate(OmegaConf.create({"_component_": TASKS[task]["dataset"]}), tok,
                            split=split, max_samples=n)  # fmt: skip
    out = []
    for i in range(len(ds)):
        s = ds[i]
        out.append(dict(s, required=required_tokens(task, s, ds.answer(i), tok)))
    return out


def score_batch(logits: torch.Tensor, labels: torch.Tensor, required: list) -> tuple:
    """``(summed cross-entropy over answer tokens, answer tokens, exact-match flags)`` of one
    batch; ``labels`` ``(b, s)`` unshifted (position t's logits predict labels[t + 1])."""
    ce, _ = next_token_loss(logits, labels, IGNORE)  # squash's held-out loss
    logits, targets = logits[:, :-1], labels[:, 1:]
    valid = targets != IGNORE
    rank = torch.cumsum(valid.int(), dim=1)  # 1 at a row's first answer token
    need = valid & (rank <= torch.tensor(required, device=labels.device)[:, None])
    hit = ((logits.argmax(-1) == targets) | ~need).all(-1)
    return float(ce), int(valid.sum()), [bool(h) for h in hit]


@torch.no_grad()
def evaluate(model, samples: list, *, pad_id: int, device, batch: int = 16) -> dict:
    """Held-out loss per answer token and exact match over ``samples``."""
    was = model.training
    model.eval()
    ce = tokens = 0
    hits = []
    for i in range(0, len(samples), batch):
        part = samples[i : i + batch]
        b = padded_collate_sft([{k: s[k] for k in ("tokens", "labels")} for s in part],
                               padding_idx=pad_id, ignore_idx=IGNORE)  # fmt: skip
        logits = model(b["tokens"].to(device))
        if isinstance(logits, list):
            logits = torch.cat(logits, dim=1)
        c, t, h = score_batch(logits, b["labels"].to(device), [s["required"] for s in part])
        ce, tokens, hits = ce + c, tokens + t, hits + h
    model.train(was)
    return {"loss": ce / tokens, "exact_match": sum(hits) / len(hits)}


# ---- one run ------------------------------------------------------------------------------------
def write_text(path: Path, text: str) -> None:
    """``text`` at ``path``, written to a temporary file and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: Path, obj: dict) -> None:
    write_text(path, json.dumps(obj, indent=1))


def score_point(rec: dict, out: Path, best: BestState, step: int, evaluate_split, data: dict,
                steps: int, train_losses: list, t_start: float, label: str) -> None:  # fmt: skip
    """Score the point at ``step`` (every split but the :data:`LATE` ones, which only at step 0
    and, at the last step, on the best validation point's state as ``rec["best"]``), append it
    to ``rec`` and write ``rec`` to ``out``."""
    t = time.perf_counter()
    p = dict(step=step, **{k: evaluate_split(k, v) for k, v in data.items()
                           if step == 0 or k not in LATE})  # fmt: skip
    best.consider(step, p["val"]["loss"])
    if step == steps and any(k in data for k in LATE):
        rec["best"] = best.score(lambda: {k: evaluate_split(k, data[k]) for k in LATE if k in data})
    p.update(train_loss=statistics.fmean(train_losses) if train_losses else None,
             eval_s=time.perf_counter() - t, wall_s=time.perf_counter() - t_start)
    train_losses.clear()
    rec["points"] = [q for q in rec["points"] if q["step"] < step] + [p]
    write_json(out, rec)
    print(f"[{label}] step {step}: val {p['val']['loss']:.4f}/{p['val']['exact_match']:.3f}"
          f" test {p['test']['loss']:.4f}/{p['test']['exact_match']:.3f} "
          f"({p['wall_s']:.0f} s)", flush=True)  # fmt: skip


def run_one(task: str, arm: dict, lr: float, seed: int, frac: float, *, size: dict, ckpt: Path,
            out: Path, work: Path, data: dict, n_train: int, device: str, dtype: str,
            keep: bool = False) -> dict:  # fmt: skip
    """One run, resumed where a killed one stopped; its record is rewritten after every
    point. A finished run's checkpoints are deleted unless ``keep``."""
    from squash_finetune import SquashFinetuneRecipeSingleDevice

    rid = run_id(arm["key"], lr, seed, frac)
    run_dir = work / "runs" / task / rid
    rec = json.loads(out.read_text()) if out.exists() else None
    from squash.runs.checkpoint import latest_checkpoint

    if rec is None or not rec["points"] or latest_checkpoint(run_dir) is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        rec = dict(id=rid, task=task, arm=arm, lr=lr, seed=seed, frac=frac, size=size,
                   n_train=n_train, device=device, dtype=dtype, points=[], done=False,
                   sessions=[])  # fmt: skip
    resume = bool(rec["points"])
    rec["sessions"].append(dict(machine=host(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                                resumed_at=rec["points"][-1]["step"] if resume else 0))  # fmt: skip
    cfg = OmegaConf.create(recipe_config(task, arm, lr, seed, frac, run_dir, ckpt, size, n_train,
                                         device, dtype, resume))  # fmt: skip
    train_losses = []
    t_start = time.perf_counter()
    best = []  # the BestState, once the model is built

    def point(recipe, step):
        if not best:
            best.append(BestState(recipe._model, run_dir / "best.pt", lambda n: ".lora_" in n))
        kw = dict(pad_id=recipe._tokenizer.pad_id, device=recipe._device)
        score_point(rec, out, best[0], step, lambda k, v: evaluate(
            recipe._model, v, batch=EVAL_BATCH.get(k, 16), **kw), data, size["steps"],
            train_losses, t_start, f"{task} {rid}")  # fmt: skip

    class CurveRecipe(SquashFinetuneRecipeSingleDevice):
        def save_checkpoint(self, epoch, name=None):
            path = super().save_checkpoint(epoch, name)
            if name is not None and name.startswith("step_"):
                point(self, int(name[len("step_") :]))
            return path

    recipe = CurveRecipe(cfg=cfg)
    try:
        recipe.setup(cfg=cfg)
        log_dict = recipe._metric_logger.log_dict

        def logged(payload, step):
            if "loss" in payload:
                train_losses.append(float(payload["loss"]))
            return log_dict(payload, step)

        recipe._metric_logger.log_dict = logged
        if not rec["points"]:
            point(recipe, 0)
        elif recipe.global_step > rec["points"][-1]["step"]:
            point(recipe, recipe.global_step)
        recipe.train()
    finally:
        recipe.cleanup()
    rec["done"] = rec["points"][-1]["step"] == size["steps"]
    rec["sessions"][-1]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec["sessions"][-1]["seconds"] = time.perf_counter() - t_start
    write_json(out, rec)
    if rec["done"] and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rec


def work_loop(args) -> None:
    size = dict(QUICK if args.quick else FULL)
    tasks = args.tasks.split(",")
    results = args.results or (RESULTS.with_name("quality_curves_quick") if args.quick else RESULTS)
    work = args.work or (WORK.with_name("quality_curves_quick") if args.quick else WORK)
    if args.threads:
        torch.set_num_threads(args.threads)
    import squash_finetune  # noqa: F401

    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torchtune", "squash")):
            logging.getLogger(name).setLevel(logging.WARNING)
    from squash.models.smollm2 import smollm2_tokenizer

    ckpt = Path(args.checkpoint_dir or DEFAULT_CKPT)
    by_key = arms(size["steps"])
    cache = {}
    ran = 0
    while args.max_runs is None or ran < args.max_runs:
        todo = None
        done = {task: load_done(results / task, size["steps"]) for task in tasks}
        queue = sorted(((stage, tasks.index(task), rid, task, arm, lr, seed, frac)
                        for task in tasks
                        for stage, rid, arm, lr, seed, frac in plan(task, done[task], args.quick)
                        if rid not in done[task]),
                       key=lambda q: q[:2])  # fmt: skip
        for _, _, rid, task, arm, lr, seed, frac in queue:
            try:
                claim = Claim(work, f"{task}_{rid}")
            except OSError:
                continue
            todo = (task, rid, arm, lr, seed, frac, claim)
            break
        if todo is None:
            print("nothing left to run (or everything left is claimed)", flush=True)
            return
        task, rid, arm, lr, seed, frac, claim = todo
        try:
            if task not in cache:
                tok = smollm2_tokenizer(str(ckpt), max_seq_len=TASKS[task]["max_seq_len"])
                data = {"val": load_split(task, tok, "validation", size["n_val"]),
                        "test": load_split(task, tok, "test", size["n_test"])}  # fmt: skip
                cache[task] = (data, _n_train(task))
            data, n_train = cache[task]
            print(f"[{task} {rid}] starting ({by_key[arm]['name']}, lr {lr:.0e}, seed {seed}, "
                  f"data {frac:g})", flush=True)  # fmt: skip
            run_one(task, by_key[arm], lr, seed, frac, size=size, ckpt=ckpt,
                    out=results / task / f"{rid}.json", work=work, data=data, n_train=n_train,
                    device=args.device, dtype=args.dtype, keep=args.keep_checkpoints)  # fmt: skip
        finally:
            claim.release()
        ran += 1


def _n_train(task: str) -> int:
    if task == "unicode":
        from squash.datasets.unicode_names import unicode_name_pairs

        return len(unicode_name_pairs("train"))
    from squash.datasets.python_docs import python_doc_splits

    return len(python_doc_splits()["train"])


# ---- the command line ---------------------------------------------------------------------------


def status(results: Path, work: Path, tasks: list, size: dict, quick: bool) -> str:
    out = []
    for task in tasks:
        done = load_done(results / task, size["steps"])
        partial = [r for r in load_records(results / task) if not r.get("done")]
        todo = [q for q in plan(task, done, quick) if q[1] not in done]
        running = []
        for q in todo:
            try:
                Claim(work, f"{task}_{q[1]}").release()
            except OSError:
                running.append(q[1])
        waiting = [q[1] for q in todo if q[1] not in running]
        out.append(f"{task}: {len(done)} done; running: {', '.join(running) or 'none'}; "
                   "stopped part-way: "
                   + (", ".join(f"{r['id']} at step {r['points'][-1]['step'] if r['points'] else 0}"
                                for r in partial if r["id"] not in running) or "none")
                   + f"; queued now: {len(waiting)}" + (f" (next {waiting[0]})" if waiting else ""))  # fmt: skip
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["work", "status", "report"])
    p.add_argument("--tasks", default="unicode,pydocs", help="comma-separated, in priority order")
    p.add_argument("--quick", action="store_true", help="toy sizes: every stage in minutes")
    p.add_argument("--checkpoint-dir", default=None, help="squash download's output directory")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None, help="claims and run checkpoints")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-runs", type=int, default=None)
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished run's checkpoints in --work (default: deleted)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--png-dir", type=Path, default=None,
                   help="report: also copy each task's PNG here as quality_curves_<task>.png "
                        "(the README shows docs/benchmarks/quality_curves_*.png)")
    args = p.parse_args(argv)
    if args.command == "work":
        return work_loop(args)
    size = dict(QUICK if args.quick else FULL)
    results = args.results or (RESULTS.with_name("quality_curves_quick") if args.quick else RESULTS)
    tasks = args.tasks.split(",")
    if args.command == "status":
        print(status(results, args.work or WORK, tasks, size, args.quick))
    else:
        text = report(results, tasks, size, args.png_dir)
        write_text(results / "README.md", text)
        print(text)
        print(f"Wrote {results / 'README.md'} and a PNG per task beside it")


if __name__ == "__main__":
    main(sys.argv[1:])

