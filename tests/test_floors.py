"""The packages stand on floors and only import downward (issue 27):

    kog_cli (the commands)  ->  workers  ->  kog_dist (the core)  ->  kccl, topology, launch (the base)

A package may import any package on a lower floor. Within the base only the edges listed in BASE_EDGES
are allowed (today's order: launch uses kccl's MPI helpers; kccl and topology import no other package of
the project). Every import counts, at module top or inside a function, plus importlib.import_module
with a literal name. A new top-level package must be given a floor here before it passes."""
from __future__ import annotations

import ast
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOORS = {"kog_cli": 3, "workers": 2, "kog_dist": 1, "kccl": 0, "topology": 0, "launch": 0}
BASE_EDGES = {("launch", "kccl")}


def packages(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root)
                  if d != "tests" and os.path.isfile(os.path.join(root, d, "__init__.py")))


def imported_names(tree: ast.AST):
    """(module name, line) for every absolute import in the tree (relative ones stay in their package)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            yield node.args[0].value, node.lineno


def allowed(src: str, dst: str) -> bool:
    if FLOORS[src] > FLOORS[dst]:
        return True
    return (src, dst) in BASE_EDGES


def violations(root: str) -> list[str]:
    """Every import of one project package by another that breaks the floors, as 'file:line: a -> b'."""
    pkgs = packages(root)
    bad = [f"{p}: a top-level package with no floor in tests/test_floors.py" for p in pkgs if p not in FLOORS]
    for p in pkgs:
        if p not in FLOORS:
            continue
        for dirpath, _, files in os.walk(os.path.join(root, p)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), filename=path)
                for name, line in imported_names(tree):
                    q = name.split(".")[0]
                    if q in FLOORS and q != p and not allowed(p, q):
                        bad.append(f"{os.path.relpath(path, root)}:{line}: {p} -> {q} ({name})")
    return bad


def test_no_package_imports_upward():
    bad = violations(REPO_ROOT)
    assert not bad, "imports that break the floors (kog_cli -> workers -> kog_dist -> kccl/topology/launch):\n" \
        + "\n".join(bad)


def _tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for p in FLOORS:
        (tmp_path / p).mkdir(exist_ok=True)
        (tmp_path / p / "__init__.py").touch()
    return str(tmp_path)


def test_an_upward_import_inside_a_function_is_found(tmp_path):
    root = _tree(tmp_path, {
        "kog_dist/engine.py": "import numpy\nfrom kccl import shm\n\ndef f():\n    from workers.rank import x\n",
        "kccl/shm.py": "import importlib\n\ndef g():\n    return importlib.import_module('kog_dist.config')\n",
        "topology/probe.py": "import launch.cli\n",
        "launch/cli.py": "from kccl.mpirun import find_mpiexec\nfrom . import discovery\n",
        "workers/rank.py": "from kog_dist import engine\nimport kccl\n",
        "kog_cli/cli.py": "import workers.rank, kog_dist, topology\n",
    })
    bad = violations(root)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "kccl -> kog_dist (kog_dist.config)", "kog_dist -> workers (workers.rank)", "topology -> launch (launch.cli)"]
    assert bad[1].startswith(os.path.join("kog_dist", "engine.py") + ":5:")


def test_a_package_without_a_floor_is_refused(tmp_path):
    root = _tree(tmp_path, {"newpkg/__init__.py": ""})
    assert violations(root) == ["newpkg: a top-level package with no floor in tests/test_floors.py"]
