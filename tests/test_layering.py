"""The package's modules form layers: each imports only modules of lower layers, so a call goes
down (the sender's path for one layer: transfer.sender -> transfer.gather -> convert -> jobs ->
backends -> kernels) and never climbs back. No import cycle exists, and no glm_fp8 import hides
inside a function to dodge one (the CLI's lazy imports, which let ``glm-fp8`` choose Triton's
interpreter before the kernels load, the package's lazy exports and ``engine.layout``'s aliases of
the names that moved up to ``engine.rules`` are the exceptions).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "glm_fp8"

# Old paths of moved modules, kept as re-exports so that old imports work (the transfer plan and the
# wire regions moved from engine/ to transfer/; integrations.vllm.engine is now updater and probe).
ALIASES = {"engine.pack", "engine.routes", "integrations.vllm.engine"}

# Lowest first. A module may import modules of earlier layers only.
LAYERS = [
    ["errors", "numerics"],
    ["_checks"],
    ["config", "engine.layout"],
    ["presets", "indexer"],
    ["models", "fleet"],
    ["layer_plan"],
    ["trainer_layouts"],
    ["plan", "kernels", "kernels.checksum"],
    ["reference", "kernels.triton_quantize", "kernels.cuda"],
    ["kernels.triton_launch", "kernels.torch_ref"],
    ["kernels.triton_delta"],
    ["backends"],
    ["jobs"],
    ["quantize", "delta"],
    ["convert", "memory", "engine.rules", "delta_cut"],
    ["engine.specs"],
    ["engine.postload"],
    ["transfer.liveness"],
    ["transfer.wire", "transfer.link", "transfer.delta_versions"],
    [
        "transfer.pack",
        "transfer.land",
        "transfer.votes",
        "transfer.trainer_input",
        "transfer.topology",
        "transfer.delta_wire",
    ],
    ["transfer.owners"],
    ["transfer.routes"],
    ["transfer.endpoint"],
    ["transfer.gather", "transfer.delta_plan"],
    ["transfer.share", "update_delta"],
    ["transfer.delta_send", "transfer.delta_receive", "transfer.delta_carry"],
    ["transfer.sender", "transfer.receiver", "integrations.vllm.gate"],
    [
        "transfer",
        "engine",
        "integrations",
        "integrations.prime_rl",
        "integrations.vllm.probe",
        "integrations.vllm.updater",
        "integrations.vllm.sync",
        "integrations.vllm.sources",
        "testing",
    ],
    ["integrations.vllm.clients"],
    ["integrations.vllm.fleet_link", "integrations.vllm.trainer_options", "integrations.vllm.trainer_source"],
    ["integrations.vllm.trainer_fleet"],
    ["integrations.vllm.worker", "integrations.vllm.trainer"],
    ["integrations.vllm"],
    ["integrations.vllm.backend", "update_time", "plan_request"],
    ["plan_summary"],
    ["plan_deployment", "plan_text_parts"],
    ["planning", "plan_text"],
    ["bench", "demo", "cli_args", "cli_plan"],
    ["cli", "__init__", *sorted(ALIASES)],  # on top: no module of glm_fp8 imports an old path
]
# cli_args, cli_plan: the CLI's option parsers and plan command, lazy as the CLI; engine.layout: old
# names resolved on first use
LAZY_ALLOWED = {"cli", "cli_args", "cli_plan", "__init__", "engine.layout"}


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


def test_engine_holds_only_the_parameters():
    """engine/ is how a vLLM rank holds its parameters (layout, shard rules, specs, post-load); the
    transfer plan and the wire regions are transfer/'s: no engine module imports transfer/, and no
    module, even inside a function, imports an old path that ``ALIASES`` keeps."""
    bad = []
    for mod, path in _modules().items():
        if mod in ALIASES:
            continue
        top, local = _imports(path)
        if mod == "engine" or mod.startswith("engine."):
            bad += [f"{mod} imports {d}" for d in sorted(top | local) if d.split(".")[0] == "transfer"]
        bad += [f"{mod} imports the old path {d}" for d in sorted((top | local) & ALIASES)]
    assert not bad, bad


def test_moved_names_keep_their_old_paths():
    """A module split keeps every moved name importable from its old module, as the same object."""
    import glm_fp8.engine.layout as layout
    from glm_fp8 import indexer, layer_plan, models, plan, presets, trainer_layouts
    from glm_fp8.engine import rules
    from glm_fp8.integrations.vllm import engine, probe, trainer, trainer_options, updater

    for name in ("PRESETS", "SMALL_CONFIGS", "SMALL_GLM5", "TINY_GLM5", "load_config"):
        assert getattr(models, name) is getattr(presets, name), name
    for name in ("INDEXER_FAMILIES", "INDEXER_PREFIX", "has_indexer", "indexer_shapes", "skip_topk_layers"):
        assert getattr(models, name) is getattr(indexer, name), name
    assert layout._Rules is rules.ShardRules
    for name in ("MTP_OWN", "NON_LAYER", "VOCAB_PAD", "kernel_entry_shapes", "shard_for", "split_name"):
        assert getattr(layout, name) is getattr(rules, name), name
    assert not hasattr(layout, "no_such_name")
    for name in plan.__all__:
        for home in (layer_plan, trainer_layouts):
            if hasattr(home, name):
                assert getattr(plan, name) is getattr(home, name), name
    assert {"LayerPlan", "PlanEntry", "align", "adapt_plan", "relayout", "strip_layer"} <= set(plan.__all__)
    assert trainer.TrainerOptions is trainer_options.TrainerOptions
    for name in engine.__all__:
        assert getattr(engine, name) is getattr(updater if name in updater.__all__ else probe, name), name


def test_plan_report_modules_keep_their_old_paths():
    """planning's and cli's names that moved (the request, the deployment sections, the text) stay
    importable from their old module, as the same object."""
    from glm_fp8 import cli, cli_args, plan_deployment, plan_request, plan_text, planning

    for name in planning.__all__:
        for home in (plan_request, plan_deployment):
            if hasattr(home, name):
                assert getattr(planning, name) is getattr(home, name), name
    moved = {"PlanRequest", "MASTER_DTYPES", "MODE_STRATEGY", "engine_extra", "plan_report"}
    assert moved <= set(planning.__all__)
    assert cli.WIDTH is plan_text.WIDTH
    assert cli.positive_int is cli_args.positive_int and cli.positive_float is cli_args.positive_float


def test_tests_mirror_the_package(pytestconfig):
    """tests/ has one folder per part of the package (its subpackages), each test in it marked with
    the folder's name (tests/conftest.py), every marker registered (pyproject.toml, as pytest read
    it: the same on every supported Python), so that ``pytest -m transfer`` runs the transfer's
    tests and nothing else."""
    import conftest

    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders == set(conftest.PARTS)
    for part in conftest.PARTS:
        assert (PACKAGE / part / "__init__.py").is_file(), f"tests/{part}/ names no package of glm_fp8"
    registered = {m.split(":")[0] for m in pytestconfig.getini("markers")}
    assert {*conftest.PARTS, "core"} <= registered


def test_renamed_names_keep_working():
    """Renamed for one meaning per word (docs/map.md#words): the old names are the same objects."""
    import glm_fp8
    from glm_fp8 import transfer
    from glm_fp8.transfer import sender

    assert glm_fp8.Broadcaster is glm_fp8.Sender is transfer.Broadcaster is transfer.Sender is sender.Sender
    assert sender.Sender.broadcast_model is sender.Sender.send_model


def test_the_old_mode_keyword_still_names_the_wire_format():
    """``mode=`` ("fp8" / "bf16") is now ``wire=``: the old keyword still works, with a
    DeprecationWarning, and contradicting ``wire=`` is refused; ``MODES`` is ``WIRE_FORMATS``."""
    import warnings

    import pytest

    from glm_fp8.models import TINY_GLM5
    from glm_fp8.plan import plans_for_model
    from glm_fp8.transfer import HostSinkComm, Receiver, Sender, endpoint, wire

    assert endpoint.MODES is wire.MODES is wire.WIRE_FORMATS
    with pytest.warns(DeprecationWarning, match="wire="):
        sender = Sender(HostSinkComm(), 0, config=TINY_GLM5, mode="bf16", device="cpu")
    assert sender.wire == "bf16" and sender.payload() == Sender(
        HostSinkComm(), 0, config=TINY_GLM5, wire="bf16", device="cpu").payload()  # fmt: skip
    with pytest.raises(ValueError, match="two wire formats"):
        Receiver(None, 0, config=TINY_GLM5, wire="bf16", mode="fp8", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Sender(HostSinkComm(), 0, config=TINY_GLM5, device="cpu").wire == "fp8"
    with pytest.warns(DeprecationWarning):
        old = plans_for_model(TINY_GLM5, mode="bf16")
    assert [p.manifest() for p in old] == [p.manifest() for p in plans_for_model(TINY_GLM5, "bf16")]
