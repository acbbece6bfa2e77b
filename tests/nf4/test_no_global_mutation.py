"""squash replaces nothing of torchao's or torchtune's: every attribute of torchao's
``NF4Tensor``, torchtune's ``LoRALinear``, ``DoRALinear``, ``FrozenNF4Linear`` and decoder
classes, torchao's NF4 op and torch-function tables and the module globals torchtune's NF4
modules call hold the very same objects (by identity) before and after importing squash, and
before and after building every kind of squash NF4 model, a full ``tune run squash_finetune``
of the tiny OPT on a corrected base with mask updates, the merge its export runs and its chat
model. Each runs in a fresh process (:mod:`tests.nf4._mutation_probe`); a control shows the
probe sees the one-attribute change squash's builders used to make."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, logged

PROBE = REPO / "tests" / "nf4" / "_mutation_probe.py"


def _probe(*args: str, timeout: int = 600) -> dict:
    proc = subprocess.run([sys.executable, str(PROBE), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_the_probe_sees_a_replaced_attribute_and_a_registered_op():
    assert _probe("control")[-1]["changed"] == {
        "vars(torchao.dtypes.nf4tensor.NF4Tensor)": ["quantize_tensor_nearest"],
        "torchao NF4_OPS_TABLE": ["aten.clone.default"],
    }


def test_importing_squash_alone_changes_nothing_and_imports_no_torchtune():
    assert _probe("import")[-1] == {"changed": {}, "torchtune_imported": False}


@pytest.mark.slow
def test_building_training_exporting_and_chatting_change_nothing(tmp_path):
    *outputs, last = _probe("run", str(tmp_path))
    assert last == {"changed": {}}
    done = outputs[-1]  # what the run, the merge and the chat gave: they did run
    epoch = tmp_path / "run" / "epoch_0"
    assert (epoch / "squash_adapter.safetensors").is_file()
    recorded = json.loads((epoch / "squash_adapter_config.json").read_text())["model"]
    assert recorded["base_outliers"]["fraction"] == 0.02  # trained on a corrected base
    assert sorted(logged(tmp_path / "run", "mask_update/replaced_per_row")) == [2, 4]
    assert sorted(logged(tmp_path / "run")) == [1, 2, 3, 4]
    assert "adapter_model.safetensors" in done["adapter"]
    assert done["merged"] > 0 and len(done["chat"]) >= 1


def test_no_package_of_squash_reaches_another_through_importlib():
    """Packages import each other with plain imports (a lazy load inside one package, such as
    ``squash.nf4``'s own modules, is that package's business)."""
    import ast

    reached = []
    for path in sorted((REPO / "squash").glob("*/**/*.py")):
        package = path.relative_to(REPO / "squash").parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name not in ("import_module", "__import__"):
                continue
            arg = node.args[0]
            text = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
            target = str(text).strip("f'\"").split(".")
            if target[0] == "squash" and len(target) > 1 and target[1] != package:
                reached.append(f"{path.relative_to(REPO)}:{node.lineno} {text}")
    assert reached == []
