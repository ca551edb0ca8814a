"""The library's exceptions: every class glm_fp8 defines derives from ``GlmFp8Error`` and lives in
``glm_fp8.core.errors``; each keeps its builtin base (``except ValueError`` catches a refused
argument), and the public ones are exported where docs/api.md shows them.
"""

import ast
import builtins
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import glm_fp8
from glm_fp8.core import errors
from glm_fp8.core.errors import GlmFp8Error

PACKAGE = Path(glm_fp8.__file__).resolve().parent

# (class, its builtin base, the public modules that export it beside glm_fp8 and glm_fp8.core.errors)
CLASSES = [
    ("UpdateAborted", RuntimeError, []),
    ("ManifestMismatch", ValueError, []),
    ("ReceiverRefused", RuntimeError, []),
    ("LinkLost", RuntimeError, []),
    ("LayerOrderError", ValueError, []),
    ("NonFiniteError", ValueError, []),
    ("EngineNotSupported", ValueError, ["glm_fp8.integrations.vllm"]),
    ("BackendUnavailable", RuntimeError, []),
    ("PlanArgumentError", ValueError, []),
]


def _package_modules():
    """Every importable glm_fp8 module; those that import vLLM at import time are skipped (not
    installed here): the source scan below still reads them."""
    mods = [glm_fp8]
    for info in pkgutil.walk_packages(glm_fp8.__path__, "glm_fp8."):
        try:
            mods.append(importlib.import_module(info.name))
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("vllm"):
                raise
    return mods


def test_every_exception_class_is_a_glm_fp8_error_defined_in_errors():
    found = {}
    for mod in _package_modules():
        for obj in vars(mod).values():
            ours = isinstance(obj, type) and obj.__module__.startswith("glm_fp8")
            if ours and issubclass(obj, BaseException):
                found[obj.__qualname__] = obj
    assert {name for name, _, _ in CLASSES} | {"GlmFp8Error"} <= set(found), sorted(found)
    bad = {n: c.__module__ for n, c in found.items() if not issubclass(c, GlmFp8Error)}
    assert not bad, f"exception classes outside GlmFp8Error: {bad}"
    elsewhere = {n: c.__module__ for n, c in found.items() if c.__module__ != "glm_fp8.core.errors"}
    assert not elsewhere, f"exception classes defined outside glm_fp8.core.errors: {elsewhere}"
    assert sorted(found) == sorted(errors.__all__)


def test_no_module_but_errors_defines_an_exception_class():
    """The source, not the imported modules: also classes nested in functions and the modules that
    need vLLM to import."""
    exceptions = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)}
    exceptions = {n for n in exceptions if issubclass(getattr(builtins, n), BaseException)}
    exceptions |= set(errors.__all__)
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "core" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & exceptions:
                    bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not bad, f"exception classes defined outside glm_fp8/core/errors.py: {bad}"


@pytest.mark.parametrize("name, builtin, modules", CLASSES, ids=[c[0] for c in CLASSES])
def test_builtin_bases_and_public_exports(name, builtin, modules):
    cls = getattr(errors, name)
    assert issubclass(cls, GlmFp8Error) and issubclass(cls, builtin)
    assert getattr(glm_fp8, name) is cls
    for module_name in modules:
        module = importlib.import_module(module_name)
        assert getattr(module, name) is cls, module_name
        if hasattr(module, "__all__"):
            assert name in module.__all__, module_name
    assert "GlmFp8Error" in glm_fp8.__all__ and glm_fp8.GlmFp8Error is GlmFp8Error


def test_library_failures_are_caught_as_glm_fp8_error():
    """Real raises, each caught by the base class and by the builtin it kept, with its attributes."""
    from glm_fp8.kernels.jobs import check_finite_tensors
    from glm_fp8.planning.request import PlanRequest
    from glm_fp8.transfer.wire import compare_manifest

    t = torch.zeros(2, 3)
    t[1, 2] = float("nan")
    with pytest.raises(GlmFp8Error) as exc:
        check_finite_tensors([("w", t)])
    assert isinstance(exc.value, ValueError) and exc.value.source == "w" and exc.value.block is None

    with pytest.raises(GlmFp8Error) as exc:
        PlanRequest(trainer_gpus=0).check()
    assert isinstance(exc.value, ValueError) and exc.value.argument == "trainer_gpus"
    assert str(exc.value) == f"trainer_gpus: {exc.value.message}"

    with pytest.raises(GlmFp8Error, match="manifest: expected a JSON object, got list") as exc:
        compare_manifest([], {}, [], require_checksum=False)
    assert isinstance(exc.value, ValueError)
