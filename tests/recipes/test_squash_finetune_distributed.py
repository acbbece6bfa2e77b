"""squash_finetune_distributed run for real: ``tune run --nproc_per_node 2`` on the CPU (gloo),
on the tiny OPT in assets/, compared with the single-device recipe."""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    QUICK,
    REPO,
    TUNE,
    assembled_from_checkpoint,
    launcher,
    logged,
    tune_run,
)

pytestmark = pytest.mark.slow  # 2 processes on the CPU; they still run in CI

TINY = REPO / "assets" / "tiny_opt"
DIST_CONFIG = REPO / "configs" / "opt_tiny_distributed.yaml"
RECIPE = "squash_finetune_distributed"

# 2 epochs of 3 optimizer steps, 2 micro-batches each; A sparse; masks move after
# steps 2 and 4; step checkpoints after steps 2, 4 and 6.
KEYS = ["epochs=2", "max_steps_per_epoch=3", "gradient_accumulation_steps=2",
        "mask_update.every_n_steps=2", "mask_update.until_step=6",
        "save_every_n_steps=2", "keep_last_n=5"]  # fmt: skip
STEPS = list(range(1, 7))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same global batch (8 samples a micro-batch) on one device and on two processes."""
    root = tmp_path_factory.mktemp("dist")
    tune_run(root / "single", *KEYS, "batch_size=8")
    tune_run(root / "dist", *KEYS, "batch_size=4", "debug=True", recipe=RECIPE,
             config=DIST_CONFIG, nproc=2)  # fmt: skip
    return root


def test_rank_zero_draws_the_picture_of_what_it_logged(runs):
    from squash.training import plot

    pytest.importorskip("matplotlib")
    fig = plot.figure(plot.read_logs(runs / "dist" / "logs"))
    lines = {line.get_label(): dict(zip(line.get_xdata().tolist(), line.get_ydata().tolist()))
             for ax in fig.axes for line in ax.get_lines()}  # fmt: skip
    assert lines == {"training loss": logged(runs / "dist"), "learning rate": logged(runs / "dist", "lr")}
    assert sorted(lines["training loss"]) == STEPS
    drawn = (runs / "dist" / "training.png").read_bytes()  # the run's last draw had every step
    assert plot.write_picture(runs / "dist").read_bytes() == drawn


def test_each_steps_loss_matches_the_single_device_recipe(runs):
    single, dist = logged(runs / "single"), logged(runs / "dist")
    assert sorted(single) == sorted(dist) == STEPS
    for step in STEPS:
        assert dist[step] == pytest.approx(single[step], rel=1e-4), (step, single, dist)
    # The gradients agree too (a wrong scale would not show in AdamW's losses). Checked where
    # both runs hold the same parameters (lr is 0 at step 1): later, AdamW turns the rounding
    # of near-zero gradients into whole lr-sized steps, and the two runs drift apart slowly.
    single_norm, dist_norm = logged(runs / "single", "grad_norm"), logged(runs / "dist", "grad_norm")
    for step in (1, 2):
        assert dist_norm[step] == pytest.approx(single_norm[step], rel=1e-5), step
    # And the adapters: the same values but for the few entries with a near-zero gradient,
    # where AdamW turns rounding into lr-sized differences (above). After step 2 (the only
    # update with lr > 0 is 2e-3) no entry is off by 5% of that step. (Masks: next test.)
    for name in ("step_2", "epoch_1"):
        a = load_file(runs / "single" / name / "squash_adapter.safetensors")
        b = load_file(runs / "dist" / name / "squash_adapter.safetensors")
        assert sorted(a) == sorted(b)
        values = [k for k in a if not k.endswith("indices")]
        diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in values])
        assert (diff > 1e-4).float().mean() <= 0.01, (name, (diff > 1e-4).sum())
        if name == "step_2":
            assert diff.max() <= 1e-4


def test_masks_after_an_update_are_identical_across_ranks_and_moved(runs):
    from omegaconf import OmegaConf
    from torchtune import config

    from squash.assembly.adapter_init import initial_adapter_state_dict

    debug = runs / "dist" / "debug"
    assert sorted(p.name for p in debug.iterdir()) == [
        f"masks_step{s}_rank{r}.safetensors" for s in (2, 4) for r in (0, 1)
    ]
    cfg = OmegaConf.load(DIST_CONFIG).model
    with torch.device("meta"):
        model = config.instantiate(cfg)
    start = {k: v for k, v in initial_adapter_state_dict(model, 1234).items() if "indices" in k}
    single_step = {  # the single-device run's masks after the same updates
        2: load_file(runs / "single" / "step_2" / "squash_adapter.safetensors"),
        4: load_file(runs / "single" / "step_4" / "squash_adapter.safetensors"),
    }
    for step in (2, 4):
        rank0 = load_file(debug / f"masks_step{step}_rank0.safetensors")
        rank1 = load_file(debug / f"masks_step{step}_rank1.safetensors")
        assert sorted(rank0) == sorted(rank1) == sorted(start) and len(start) == 12
        for key in start:
            assert torch.equal(rank0[key], rank1[key]), (step, key)
        moved = sum(int((rank0[k] != start[k]).any()) for k in start)
        assert moved == len(start)  # every factor's mask changed
        # the masks the single-device run chose: the first update exactly; by the second the
        # values have drifted where AdamW amplifies rounding, and a near-tie may fall the
        # other way in a row or two
        rows = sum(rank0[k].shape[0] for k in start)
        differ = sum(int((rank0[k] != single_step[step][k]).any(dim=1).sum()) for k in start)
        assert differ == 0 if step == 2 else differ <= 0.01 * rows, (step, differ, rows)


def _rebuild(ckpt_dir, quantize_base, svd=False):
    """The model as squash_finetune builds it (from squash_adapter_config.json), base weights
    from the tiny OPT (with ``svd``: the residual of the same SVD, the base the run trained on),
    the adapter loaded as squash_finetune loads one on resume."""
    from omegaconf import OmegaConf
    from torchtune import config

    from squash.models.opt import OPTCheckpointer
    from squash.runs import checkpoint as ckpt

    meta = json.loads((ckpt_dir / "squash_adapter_config.json").read_text())
    model = config.instantiate(OmegaConf.create(meta["model"]), quantize_base=quantize_base,
                               init="lora")  # fmt: skip
    base = OPTCheckpointer(str(TINY), ["model.safetensors"], str(ckpt_dir.parent / "reload"))
    base_state_dict = base.load_checkpoint()["model"]
    model.load_state_dict(base_state_dict, strict=False)
    if svd:
        from squash.modules import svd_initialize

        svd_initialize(model, base_state_dict)
    ckpt.load_adapter_into(model, ckpt.load_squash_adapter(ckpt_dir), ckpt_dir)
    return model.eval()


def test_the_saved_adapter_loads_into_the_single_device_model_and_into_peft(runs):
    import transformers
    from peft import PeftModel

    epoch = runs / "dist" / "epoch_1"
    tokens = torch.randint(3, 1024, (2, 40), generator=torch.Generator().manual_seed(7))
    ours = _rebuild(epoch, quantize_base=False)
    hf = transformers.OPTForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    with torch.no_grad():
        base = hf(tokens).logits  # before PEFT wraps hf's layers in place
    peft_model = PeftModel.from_pretrained(hf, epoch / "adapter").eval()
    with torch.no_grad():
        mine, theirs = ours(tokens), peft_model(tokens).logits
    assert (mine - theirs).abs().max() <= 1e-4
    assert (base - theirs).abs().max() > 1e-3  # the adapter is not a no-op

    ours_nf4 = _rebuild(epoch, quantize_base=True)
    merged = transformers.OPTForCausalLM.from_pretrained(epoch, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ours_nf4(tokens) - merged(tokens).logits).abs().max() <= 1e-3


def test_resume_after_sigkill_reproduces_the_uninterrupted_losses(runs, tmp_path):
    whole = logged(runs / "dist")
    out = tmp_path / "killed"
    cmd = [TUNE, "run", *launcher(2), RECIPE, "--config", str(DIST_CONFIG),
           f"output_dir={out}", *QUICK, *KEYS, "batch_size=4"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (out / "step_2" / "checkpoint.json").exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before step 2"
            time.sleep(0.02)
    finally:
        # the launcher and both ranks (torchrun starts them in sessions of their own), mid-run
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in procs:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
        proc.wait()
    assert not (out / "epoch_1").exists()

    tune_run(out, *KEYS, "batch_size=4", "resume_from_checkpoint=True", recipe=RECIPE,
             config=DIST_CONFIG, nproc=2)  # fmt: skip
    resumed_log = max((out / "logs").glob("log_*.txt"), key=os.path.getmtime)
    resumed = {int(line.split()[1]): float(line.split("loss:")[1].split()[0])
               for line in resumed_log.read_text().splitlines() if line.startswith("Step ")}
    assert resumed and max(resumed) == 6 and 3 <= min(resumed) <= 5
    assert sorted(resumed) == list(range(min(resumed), 7))
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], rel=1e-6, abs=1e-6), (step, resumed, whole)
    a = load_file(runs / "dist" / "epoch_1" / "squash_adapter.safetensors")
    b = load_file(out / "epoch_1" / "squash_adapter.safetensors")
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), rtol=0, atol=1e-6), key


def test_cpu_offload_activation_checkpointing_and_no_reshard_give_the_same_run(runs, tmp_path):
    out = tmp_path / "offload"
    tune_run(out, *KEYS, "batch_size=4", "epochs=1", "max_steps_per_epoch=2",
             "save_every_n_steps=null", "save_adapter_weights_only=True", "debug=True",
             "fsdp_cpu_offload=True", "enable_activation_checkpointing=True",
             "fsdp_reshard_after_forward=False", recipe=RECIPE, config=DIST_CONFIG, nproc=2)  # fmt: skip
    plain, offload = logged(runs / "dist"), logged(out)
    assert sorted(offload) == [1, 2]  # in the warm-up: the same lr as the 2-epoch run
    for step in (1, 2):
        assert offload[step] == pytest.approx(plain[step], rel=1e-6), step
    # the mask update after step 2 (gradients recorded through the recomputed forward)
    a = load_file(runs / "dist" / "debug" / "masks_step2_rank0.safetensors")
    b = load_file(out / "debug" / "masks_step2_rank1.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_another_number_of_processes_is_refused(runs, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(runs / "dist" / "step_2", out / "step_2")
    proc = tune_run(out, *KEYS, "batch_size=4", "resume_from_checkpoint=True", recipe=RECIPE,
                    config=DIST_CONFIG, nproc=1, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "written by 2 processes, this run has 1" in proc.stderr + proc.stdout


def test_svd_init_peft_adapter_matches_the_single_device_recipes_and_transformers(tmp_path):
    """``model.init: svd`` on 2 processes exports the PEFT adapter ``squash_finetune`` exports:
    rank 2r, ``B A - B0 A0`` (the SVD delta) on the original weights, the same tensors; PEFT on
    transformers' OPT then gives squash's logits."""
    import transformers
    from peft import PeftModel

    keys = ["epochs=1", "max_steps_per_epoch=2", "model.init=svd", "~mask_update",
            "save_adapter_weights_only=True", "save_every_n_steps=null"]  # fmt: skip
    # One thread, as torchrun gives each rank: the SVD of the tiny OPT's random weights has
    # near-equal singular values, whose vectors LAPACK resolves differently on other thread counts
    one_thread = {"OMP_NUM_THREADS": "1"}
    tune_run(tmp_path / "single", *keys, "batch_size=8", env=one_thread)
    tune_run(tmp_path / "dist", *keys, "batch_size=4", recipe=RECIPE, config=DIST_CONFIG, nproc=2,
             env=one_thread)  # fmt: skip
    single, dist = tmp_path / "single" / "epoch_0", tmp_path / "dist" / "epoch_0"
    configs = [json.loads((d / "adapter" / "adapter_config.json").read_text()) for d in (single, dist)]
    assert [(c["r"], c["lora_alpha"]) for c in configs] == [(64, 128)] * 2  # 2 x (32, 64)
    a = load_file(single / "adapter" / "adapter_model.safetensors")
    b = load_file(dist / "adapter" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and len(a) == 24
    for key in a:
        assert a[key].shape == b[key].shape, key
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=key)

    tokens = torch.randint(3, 1024, (2, 40), generator=torch.Generator().manual_seed(7))
    for run in (single, dist):  # each run's PEFT adapter on the original weights
        ours = _rebuild(run, quantize_base=False, svd=True)
        hf = transformers.OPTForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
        with torch.no_grad():
            base = hf(tokens).logits
        peft_model = PeftModel.from_pretrained(hf, run / "adapter").eval()
        with torch.no_grad():
            mine, theirs = ours(tokens), peft_model(tokens).logits
        assert (mine - theirs).abs().max() <= 1e-4, run
        assert (base - theirs).abs().max() > 1e-3  # the trained adapter is not a no-op


def test_a_corrected_base_trains_as_on_one_device_and_its_merged_weights_carry_the_outliers(
    tmp_path,
):
    """``model.base_outliers`` (sensitivity) on 2 processes: the MLP's NF4 bases are sharded by
    rows, the attention's stay whole (too small to split). Each step's loss is the
    single-device recipe's, and the merged weights rank 0 gathers are ``dequant(NF4(W - S)) +
    S + B A`` of the model rebuilt on one device with the run's adapter, for a sharded weight and
    a whole one."""
    from squash.nf4.base_outliers import module_outliers

    keys = ["epochs=1", "max_steps_per_epoch=2", "~mask_update", "save_every_n_steps=null",
            "model.base_outliers.fraction=0.02", "model.base_outliers.criterion=sensitivity",
            "model.base_outliers.calibration.samples=4",
            "model.base_outliers.calibration.max_seq_len=64"]  # fmt: skip
    tune_run(tmp_path / "single", *keys, "batch_size=8")
    proc = tune_run(tmp_path / "dist", *keys, "batch_size=4", recipe=RECIPE, config=DIST_CONFIG,
                    nproc=2)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "NF4 + FFI outliers" in out
    assert "8 NF4 weights cannot be split evenly over 2 ranks" in out  # q, k, v, out x 2 layers
    single, dist = logged(tmp_path / "single"), logged(tmp_path / "dist")
    assert sorted(single) == sorted(dist) == [1, 2]
    for step in (1, 2):
        assert dist[step] == pytest.approx(single[step], rel=1e-4), (step, single, dist)

    epoch = tmp_path / "dist" / "epoch_0"
    model = assembled_from_checkpoint(epoch, tmp_path / "reload")
    merged = load_file(epoch / "model.safetensors")
    layer = model.layers[1]
    for module, key in ((layer.mlp.w1, "fc1"), (layer.attn.q_proj, "self_attn.q_proj")):
        assert module_outliers(module) is not None, key
        torch.testing.assert_close(merged[f"model.decoder.layers.1.{key}.weight"],
                                   module.merged_weight(torch.float32), rtol=0, atol=1e-6,
                                   msg=key)  # fmt: skip
