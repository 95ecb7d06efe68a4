"""Source checks that need no GPU: a function that imports a module its file already imports at the top
makes that name local to the whole function, so any use above the import raises UnboundLocalError (the
cuda_ipc bench's NCCL row failed so, on the GPU only, where no CPU test reaches)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kog_dist", "workers", "kccl", "topology", "launch")


def _imported(nodes) -> set[str]:
    names = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            names |= {a.asname or a.name for a in n.names}
    return names


def _own_body(fn):
    """The statements of fn, not of the functions and classes nested in it."""
    stack = list(fn.body)
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(n))


def shadowing_imports(source: str) -> list[str]:
    tree = ast.parse(source)
    top = _imported(tree.body)
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for name in sorted(_imported(_own_body(fn)) & top):
                found.append(f"{fn.name}:{fn.lineno} imports {name} again")
    return found


def test_the_check_finds_the_pattern_and_passes_its_absence():
    bad = "import json\ndef f(x):\n    y = json.dumps(x)\n    if x:\n        import json\n    return y\n"
    assert shadowing_imports(bad) == ["f:2 imports json again"]
    assert shadowing_imports("def f(x):\n    import json\n    return json.dumps(x)\n") == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_reimports_a_module_of_its_file(package):
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        problems += [f"{path.relative_to(ROOT)}: {p}" for p in shadowing_imports(path.read_text())]
    assert not problems, "\n".join(problems)
