"""pyproject.toml declares every third-party module the package, its tests and benchmarks import.

A fresh `pip install -e .` must be enough for `glm-fp8 demo` and `pytest -q tests`. The imports are read
with `ast` (module level and function-local alike), the standard library is left out through
`sys.stdlib_module_names`, and what remains must be a requirement in [project].dependencies (or, for
tests/ and bench/, in the `test` extra).

`numpy` is never imported by glm_fp8 itself, yet it is a runtime dependency: Triton's CPU interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py, `glm-fp8 demo` and `glm-fp8 bench` on a machine without
a GPU) imports it, and neither torch nor triton declares it. Without it a fresh venv fails both README
commands with `ModuleNotFoundError: numpy`.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Import name -> distribution name, where the two differ (e.g. "yaml": "PyYAML"). None today.
IMPORT_TO_DIST: dict[str, str] = {}

# Imported only lazily, inside a try/except or by an optional integration; not a requirement.
#   vllm: the inference engine the weights are sent to; glm_fp8 only mirrors its layouts.
#   tomli: this file's TOML parser on Python 3.10, used only when installed (else a regex).
#   transformers: a model config in tests/integrations/test_vllm_backend_real.py, which runs only where vLLM
#   (which requires it) is installed.
#   megatron: Megatron-Core, the trainer glm_fp8.integrations.megatron reads (its parallel_state, lazily)
#   and tests/integrations/test_megatron_real.py builds models with (scripts/install_megatron_cpu.sh).
#   sglang: SGLang 0.5.23, the other engine, whose runtime context glm_fp8.integrations.sglang reads
#   (lazily) and whose model classes tests/integrations/test_sglang_real.py builds
#   (scripts/install_sglang_cpu.sh).
#   uvicorn: serves SGLang's own HTTP app in tests/integrations/test_sglang_real.py (an SGLang
#   dependency, installed beside it by scripts/install_sglang_cpu.sh).
OPTIONAL = {"vllm", "tomli", "transformers", "megatron", "sglang", "uvicorn"}

# Needed at run time although no file of ours imports them (the reason is the value).
RUNTIME_WITHOUT_IMPORT = {
    "numpy": "imported by Triton's CPU interpreter (TRITON_INTERPRET=1) on machines without a GPU",
}
TEST_WITHOUT_IMPORT = {
    "pytest-benchmark": "provides the `benchmark` fixture of bench/ (a plugin, never imported)",
    "ruff": ".ci/run lints with it",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert match, f"unparsable requirement {req!r}"
    return _normalize(match.group(1))


def _regex_project_table(text: str) -> dict:
    """Tiny fallback for Python 3.10 without tomli: the two arrays this test reads."""

    def array(section: str, key: str) -> list[str]:
        body = re.search(rf"^\[{re.escape(section)}\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        if not body:
            return []
        items = re.search(rf"^{re.escape(key)}\s*=\s*\[(.*?)\]", body.group(1), re.M | re.S)
        return re.findall(r"\"([^\"]*)\"|'([^']*)'", items.group(1)) if items else []

    flat = lambda pairs: [a or b for a, b in pairs]
    return {
        "dependencies": flat(array("project", "dependencies")),
        "optional-dependencies": {"test": flat(array("project.optional-dependencies", "test"))},
    }


def _project_table() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return _regex_project_table(text)
    return tomllib.loads(text)["project"]


def _third_party_imports(directory: Path, local: set[str]) -> dict[str, list[str]]:
    """Top-level module name -> files importing it, for every absolute import under `directory`."""
    found: dict[str, list[str]] = {}
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in local or top in OPTIONAL:
                    continue
                found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


def _undeclared(imports: dict[str, list[str]], declared: set[str]) -> dict[str, list[str]]:
    return {
        mod: files
        for mod, files in imports.items()
        if _normalize(IMPORT_TO_DIST.get(mod, mod)) not in declared
    }


def test_every_runtime_import_is_a_declared_dependency():
    declared = {_requirement_name(r) for r in _project_table().get("dependencies", [])}
    imports = _third_party_imports(ROOT / "glm_fp8", local={"glm_fp8"})
    assert "torch" in imports and "triton" in imports, "the import scan found nothing: it is broken"
    missing = _undeclared(imports, declared)
    assert not missing, f"imported by glm_fp8 but not in [project].dependencies: {missing}"


def test_numpy_is_a_declared_dependency():
    declared = {_requirement_name(r) for r in _project_table().get("dependencies", [])}
    missing = {dist: why for dist, why in RUNTIME_WITHOUT_IMPORT.items() if _normalize(dist) not in declared}
    assert not missing, f"runtime dependencies missing from [project].dependencies: {missing}"


def test_tests_and_benchmarks_need_only_declared_packages():
    project = _project_table()
    declared = {_requirement_name(r) for r in project.get("dependencies", [])}
    declared |= {_requirement_name(r) for r in project.get("optional-dependencies", {}).get("test", [])}
    for directory in ("tests", "bench"):
        local = {"glm_fp8", "conftest"} | {p.stem for p in (ROOT / directory).rglob("*.py")}
        missing = _undeclared(_third_party_imports(ROOT / directory, local), declared)
        assert not missing, f"imported by {directory}/ but declared nowhere: {missing}"
    missing = {dist: why for dist, why in TEST_WITHOUT_IMPORT.items() if _normalize(dist) not in declared}
    assert not missing, f"missing from the `test` extra: {missing}"


def test_the_fallback_parser_reads_the_same_requirements():
    """The regex path (3.10 without tomli) must agree with tomllib where tomllib exists."""
    try:
        import tomllib
    except ModuleNotFoundError:
        return  # nothing to compare against; the other tests already ran on the regex path
    text = (ROOT / "pyproject.toml").read_text()
    real = tomllib.loads(text)["project"]
    rough = _regex_project_table(text)
    assert rough["dependencies"] == real["dependencies"]
    assert rough["optional-dependencies"]["test"] == real["optional-dependencies"]["test"]


def test_vllm_loads_the_backend_through_a_general_plugins_entry_point():
    """vLLM's workers build the "glm_fp8" engine from its registry, which only vLLM's plugin loader
    fills there (``vllm.general_plugins``, called in every vLLM process): without this entry point
    ``WeightTransferConfig(backend="glm_fp8")`` fails in the workers with "Invalid weight transfer
    backend". tests/integrations/test_vllm_backend_real.py runs the loader where vLLM is installed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("needs tomllib (Python 3.11+)")
    import glm_fp8.integrations.vllm as integ

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project.get("entry-points", {}).get("vllm.general_plugins", {})
    assert plugins == {"glm_fp8": "glm_fp8.integrations.vllm:register"}, plugins
    assert callable(integ.register)


def test_the_license_file_states_the_license_pyproject_declares():
    """pyproject.toml declares Apache-2.0; the repository's LICENSE (which setuptools puts in the
    wheel and sdist by its default license-file patterns) must state that same license."""
    text = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^license\s*=\s*(?:\{\s*text\s*=\s*)?"([^"]+)"', text, re.M)
    assert declared and declared.group(1) == "Apache-2.0", "pyproject.toml: expected license Apache-2.0"
    notice = (ROOT / "LICENSE").read_text()
    assert 'Licensed under the Apache License, Version 2.0 (the "License")' in notice
    assert "http://www.apache.org/licenses/LICENSE-2.0" in notice
    assert re.search(r"^Copyright \d{4} ", notice, re.M)
