"""Folders are the layers (docs/map.md): the package is a stack of subpackages, and a handful of
rules over them hold, read from the code's own imports:

1. every module lives in a layer (``LAYERS``); nothing else lies at glm_fp8's top;
2. a module imports only its own layer and the layers below it, inside functions too;
3. the modules' imports have no cycle;
4. a module imports a name from the module that defines it: no name is taken through another
   module's re-export or through its own package's ``__init__``;
5. no private name (``_x``) is imported across modules;
6. a package's ``__init__`` only re-exports (it defines nothing), and every other module defines
   something: no alias modules;
7. glm_fp8 imports inside functions only in the CLI and the package's lazy ``__init__`` (the CLI
   chooses Triton's interpreter before the kernels load).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "glm_fp8"

# Lowest first; the name of a subpackage, or of a module at glm_fp8's top.
LAYERS = ["core", "model", "kernels", "engine", "transfer", "planning", "integrations", "testing", "cli"]
LAZY = {"__init__", "cli"}  # the layers that may import glm_fp8 inside functions


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package_init(mod: str) -> str | None:
    """``a.b`` -> ``a.b.__init__`` when ``a/b/`` is a package."""
    return f"{mod}.__init__" if f"{mod}.__init__" in MODULES else None


def _target(module: str) -> str:
    """The module key a dotted import path names (a package names its ``__init__``)."""
    base = module.removeprefix("glm_fp8").lstrip(".")
    if not base:
        return "__init__"
    return _package_init(base) or base


def _imports(path: Path) -> list[tuple[str, str | None, bool, int]]:
    """(module, name or None, inside a function, line) for each glm_fp8 import of ``path``; an
    ``from p import m`` of a submodule m names the module ``p.m``."""
    tree = ast.parse(path.read_text())
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner |= {id(n) for n in ast.walk(node) if n is not node}
    out = []
    for node in ast.walk(tree):
        local = id(node) in inner
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "glm_fp8":
            base = node.module.removeprefix("glm_fp8").lstrip(".")
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                if sub in MODULES or _package_init(sub):
                    out.append((_target("glm_fp8." + sub), None, local, node.lineno))
                else:
                    out.append((_target(node.module), a.name, local, node.lineno))
        elif isinstance(node, ast.Import):
            out += [
                (_target(a.name), None, local, node.lineno)
                for a in node.names
                if a.name.startswith("glm_fp8.")
            ]
    return [(m, n, local, line) for m, n, local, line in out if m in MODULES]


def _layer(mod: str) -> str:
    return mod.split(".")[0]


def _defined(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):  # definitions under a version or import guard
            names |= {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names - {"__all__"}


def test_every_module_lives_in_a_layer():
    top = sorted(m for m in MODULES if "." not in m and m not in ("__init__", *LAYERS))
    assert not top, f"modules at glm_fp8's top outside LAYERS: {top}"
    assert {_layer(m) for m in MODULES} == {"__init__", *LAYERS}


def test_imports_go_down_only():
    rank = {name: k for k, name in enumerate(LAYERS)}
    bad = []
    for mod, path in MODULES.items():
        if mod == "__init__":
            continue
        for dep, _, _, line in _imports(path):
            if dep == "__init__" and not mod.startswith("cli."):
                bad.append(f"{mod}:{line} imports glm_fp8's lazy __init__")
            elif dep != "__init__" and rank[_layer(dep)] > rank[_layer(mod)]:
                bad.append(f"{mod}:{line} ({_layer(mod)}) imports {dep} ({_layer(dep)}, above it)")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {d for d, _, local, _ in _imports(p) if not local} - {m} for m, p in MODULES.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d) :] + [m, d]) if d in stack else f"{m} -> {d}")
            elif d not in state:
                visit(d, [*stack, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles


def test_names_come_from_their_home():
    """No re-export hops inside the package: a name is imported from the module that defines it
    (a package's ``__init__`` re-exports for users, never for glm_fp8's own modules)."""
    defined = {m: _defined(p) for m, p in MODULES.items()}
    bad = []
    for mod, path in MODULES.items():
        if mod == "__init__":
            continue
        for dep, name, _, line in _imports(path):
            if name is not None and name not in defined[dep]:
                bad.append(f"{mod}:{line} takes {name} from {dep}, which does not define it")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
    bad = [
        f"{mod}:{line} imports {name} from {dep}"
        for mod, path in MODULES.items()
        for dep, name, _, line in _imports(path)
        if name is not None and name.startswith("_") and not name.startswith("__")
    ]
    assert not bad, "\n".join(bad)


def test_no_alias_modules():
    """A package's ``__init__`` defines nothing (it re-exports); every other module defines
    something (a module that only imports is an old path kept alive)."""
    bad = []
    for mod, path in MODULES.items():
        own = _defined(path) - {"__version__"}
        if mod.endswith("__init__") and mod != "__init__" and own:
            bad.append(f"{mod} defines {sorted(own)}")
        if not mod.endswith(("__init__", "__main__")) and not own:
            bad.append(f"{mod} defines nothing")
        if "__getattr__" in own and mod != "__init__":
            bad.append(f"{mod} resolves names in a module __getattr__")
    assert not bad, bad


def test_lazy_imports_only_in_the_cli():
    bad = [
        f"{mod}:{line} imports {dep} inside a function"
        for mod, path in MODULES.items()
        if _layer(mod) not in LAZY
        for dep, _, local, line in _imports(path)
        if local
    ]
    assert not bad, "\n".join(bad)


def test_importing_the_package_loads_no_kernel():
    """``import glm_fp8`` and ``import glm_fp8.cli`` load no Triton kernel: the CLI sets Triton's
    interpreter first on a CPU (its lazy imports)."""
    import subprocess
    import sys

    code = (
        "import sys, glm_fp8, glm_fp8.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('triton', 'glm_fp8.kernels'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_tests_mirror_the_package(pytestconfig):
    """tests/ has one folder per layer of the package, each test in it marked with the folder's
    name (tests/conftest.py), every marker registered (pyproject.toml, as pytest read it), so that
    ``pytest -m transfer`` runs the transfer's tests and nothing else; the tests at tests/'s top are
    the repository's (docs, packaging, these rules), marked ``repo``."""
    import conftest

    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders == set(conftest.PARTS)
    for part in conftest.PARTS:
        assert (PACKAGE / part / "__init__.py").is_file(), f"tests/{part}/ names no package of glm_fp8"
    registered = {m.split(":")[0] for m in pytestconfig.getini("markers")}
    assert {*conftest.PARTS, "repo"} <= registered


@pytest.mark.parametrize("layer", [name for name in LAYERS if (PACKAGE / name / "__init__.py").is_file()])
def test_each_package_says_what_it_holds(layer):
    """Each layer's ``__init__`` docstring names its modules: the map a newcomer reads first."""
    init = PACKAGE / layer / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    here = sorted(
        p.stem if p.name != "__init__.py" else p.parent.name
        for p in (PACKAGE / layer).iterdir()
        if (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
        or (p / "__init__.py").is_file()
    )
    missing = [m for m in here if f"``{m}``" not in doc and f"``{m}/``" not in doc]
    assert not missing, f"glm_fp8/{layer}/__init__.py's docstring does not name {missing}"


def test_the_map_names_every_module():
    """docs/map.md lists every module in its layer's table (by its path inside the layer's folder)."""
    text = (PACKAGE.parent / "docs" / "map.md").read_text()
    missing = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(PACKAGE)
        inside = Path(*rel.parts[1:]) if len(rel.parts) > 1 else rel
        if f"`{inside.as_posix()}`" not in text:
            missing.append(rel.as_posix())
    assert not missing, f"docs/map.md does not name {sorted(missing)}"
