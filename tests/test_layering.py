"""The package's modules form layers: each imports only modules of lower layers, so a call goes
down (the sender's path for one layer: transfer.sender -> transfer.gather -> convert -> jobs ->
backends -> kernels) and never climbs back. No import cycle exists, and no glm_fp8 import hides
inside a function to dodge one (the CLI's lazy imports, which let ``glm-fp8`` choose Triton's
interpreter before the kernels load, and the package's lazy exports are the exceptions).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "glm_fp8"

# Lowest first. A module may import modules of earlier layers only.
LAYERS = [
    ["numerics", "config"],
    ["models"],
    ["plan", "_checks", "kernels", "kernels.checksum"],
    ["reference", "kernels.triton_quantize", "kernels.cuda"],
    ["kernels.triton_launch", "kernels.torch_ref"],
    ["backends"],
    ["jobs"],
    ["quantize"],
    ["convert", "memory", "engine.layout"],
    ["transfer.wire", "transfer.link", "engine.specs", "engine.pack"],
    ["engine.routes", "transfer.land", "transfer.votes", "transfer.trainer_input"],
    ["transfer.endpoint", "engine.postload"],
    ["transfer.gather"],
    ["transfer.share"],
    ["transfer.sender", "transfer.receiver"],
    [
        "transfer",
        "engine",
        "integrations",
        "integrations.prime_rl",
        "integrations.vllm.engine",
        "integrations.vllm.sync",
        "integrations.vllm.sources",
        "testing",
    ],
    ["integrations.vllm.worker", "integrations.vllm.trainer"],
    ["integrations.vllm"],
    ["integrations.vllm.backend", "update_time"],
    ["planning"],
    ["bench", "demo"],
    ["cli", "__init__"],
]
LAZY_ALLOWED = {"cli", "__init__"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """glm_fp8 modules imported at module level, and inside functions."""
    tree = ast.parse(path.read_text())
    modules = set(_modules())
    top, local = set(), set()

    def names(node) -> list[str]:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("glm_fp8"):
            base = node.module.removeprefix("glm_fp8").lstrip(".")
            # from glm_fp8[.pkg] import x: x may be a module itself
            subs = [f"{base}.{a.name}" if base else a.name for a in node.names]
            found = [m for m in subs if m in modules]
            return found if found else [base or "__init__"]
        if isinstance(node, ast.Import):
            return [a.name.removeprefix("glm_fp8.") for a in node.names if a.name.startswith("glm_fp8.")]
        return []

    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks only name types
            continue
        top.update(names(node))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                local.update(names(inner))
    # Only the package's Python modules: the compiled extension glm_fp8._C loads on first use.
    return top & modules, local & modules


def _layer_of() -> dict[str, int]:
    return {m: k for k, layer in enumerate(LAYERS) for m in layer}


def test_every_module_has_a_layer():
    layer_of = _layer_of()
    missing = sorted(set(_modules()) - set(layer_of))
    assert not missing, f"modules without a layer in LAYERS: {missing}"
    stale = sorted(set(layer_of) - set(_modules()))
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_go_down_only():
    layer_of = _layer_of()
    bad = []
    for mod, path in _modules().items():
        top, _ = _imports(path)
        for dep in top:
            dep = dep if dep in layer_of else dep.rsplit(".", 1)[0]
            if dep != mod and layer_of.get(dep, -1) >= layer_of[mod]:
                bad.append(f"{mod} (layer {layer_of[mod]}) imports {dep} (layer {layer_of.get(dep)})")
    assert not bad, "\n".join(bad)


def test_no_function_local_imports_of_the_package():
    bad = []
    for mod, path in _modules().items():
        if mod in LAZY_ALLOWED:
            continue
        _, local = _imports(path)
        if local:
            bad.append(f"{mod}: {sorted(local)}")
    assert not bad, "function-local glm_fp8 imports: " + "; ".join(bad)


def test_transfer_modules_stay_readable():
    """One module per concern in glm_fp8/transfer, none past 400 lines: the protocol is read whole
    by whoever debugs a hang, and a module that grows past that has taken a second concern."""
    long = {p.name: n for p in (PACKAGE / "transfer").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}  # fmt: skip
    assert not long, long
