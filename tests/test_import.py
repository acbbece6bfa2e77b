"""Importing squash has no side effects on torchao or torchtune: NF4Tensor's attributes and
torchao's NF4 op table (where torchtune registers its NF4 overrides) hold the very same objects
before and after (squash calls torchao's NF4 API and its own functions; it installs nothing)."""

import json
import subprocess
import sys

from tests.helpers import REPO

_PROBE = r"""
import json, sys
import torchao.dtypes.nf4tensor as nf4tensor
import torchtune.modules.low_precision  # noqa: F401  (torchtune's own NF4 registrations)
import torchtune.modules.peft, torchtune.models.llama3_2, torchtune.models.qwen2_5  # noqa: F401
import torchtune.training  # noqa: F401

def snapshot():
    cls = nf4tensor.NF4Tensor
    return ({k: id(v) for k, v in vars(cls).items()},
            {str(k): id(v) for k, v in nf4tensor.NF4_OPS_TABLE.items()},
            id(cls.quantize_tensor_nearest))

before = snapshot()
for name in sys.argv[1:]:
    __import__(name)
after = snapshot()
changed = lambda a, b: sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
print(json.dumps({
    "attributes": changed(before[0], after[0]),
    "ops": changed(before[1], after[1]),
}))
"""


def test_importing_squash_changes_no_torchao_or_torchtune_object():
    modules = ["squash", "squash.modules", "squash.models", "squash.models.opt",
               "squash.models.smollm2", "squash.nf4", "squash.nf4.modules"]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", _PROBE, *modules], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    diff = json.loads(out.strip().splitlines()[-1])
    assert diff["attributes"] == [] and diff["ops"] == [], diff


def test_the_gguf_package_loads_only_when_a_gguf_file_is_written():
    """A training recipe, the merge and chat import no GGUF writer; ``squash.export``'s GGUF
    names load it on first use."""
    probe = ("import sys; sys.path.insert(0, 'recipes'); import squash.merge, squash.chat, "
             "squash_finetune, squash_finetune_distributed; from squash.export import "
             "parse_export_config, GGUF_DTYPES; print('gguf' in sys.modules); "
             "from squash.export import write_gguf; print('gguf' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    assert out == ["False", "True"]


def test_one_version_string():
    import tomllib  # noqa: PLC0415

    import squash

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert isinstance(squash.__version__, str) and squash.__version__.count(".") == 2


def _imports(path):
    """The squash modules ``path`` imports (at any depth of the file, functions included);
    ``from squash import x`` counts as ``squash.x``."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "squash":
                names.update(f"squash.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n == "squash" or n.startswith("squash.")}


# squash's packages by floor, lowest first (docs/architecture.md, "Folders, lowest first"): a
# package imports only packages on lower floors, never one beside it or above it. The top-level
# modules (merge, chat, cli) and the recipes stand above them all.
FLOORS = [
    ["sparsity"],
    ["ops"],
    ["nf4"],
    ["modules"],
    ["export"],
    ["models"],
    ["config"],
    ["training", "runs"],
    ["assembly"],
]


def test_layers_point_down():
    """Each package of :data:`FLOORS` imports only packages on lower floors: sparsity/ imports
    none of them, ops/ does not import nf4/ (nf4 is built on ops), models/ and export/ import
    neither the config nor what reads it, config/ imports none of training/, runs/ and
    assembly/, training/ and runs/ do not import each other, and assembly/ (config -> model)
    is imported by none of them."""
    floor = {pkg: i for i, pkgs in enumerate(FLOORS) for pkg in pkgs}
    assert all((REPO / "squash" / pkg).is_dir() for pkg in floor)
    bad = []
    for pkg, level in floor.items():
        for path in (REPO / "squash" / pkg).rglob("*.py"):
            for name in _imports(path):
                other = name.split(".")[1] if name.count(".") else None
                if other in floor and other != pkg and floor[other] >= level:
                    bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, bad


def _module_graph():
    """``{module: squash modules it imports}`` over every file under ``squash/``, imports inside
    functions included; ``from squash.x import y`` counts ``squash.x.y`` where that is a module.
    A module's own parent packages are left out: Python imports them first whatever the
    module says."""
    import ast

    files = {}
    for path in (REPO / "squash").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.update(m for m in [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                           if m in files)  # fmt: skip
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in files)
        graph[name] = {m for m in out if not name.startswith(m + ".") and m != name}
    return graph


def test_no_import_circle():
    """No squash module reaches itself through the modules it imports (at any depth, function
    bodies included): the strongly connected components of the import graph are single
    modules."""
    graph = _module_graph()
    assert graph["squash.runs.run_lock"] >= {"squash.runs.manifest"}  # the graph is real
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []
