"""The path of one layer through the code: which glm_fp8 modules a sender and an engine rank enter
for one MoE layer, dense and as a delta, and how often the call path crosses from one package of
glm_fp8 to another (docs/map.md, "One layer's path").

Two ranks over gloo on the CPU (TINY_GLM5, one sparse layer, scatter to one engine rank of TP 1):
update 1 is dense, update 2 a delta of slightly moved weights. Each rank records every Python call
into glm_fp8 (``sys.setprofile``) made inside ``send_model`` / ``load_into`` and prints, per
update: the modules entered, the layers (``LAYERS``) they lie in, the calls that cross from one
layer to another (caller and callee in different layers), and of those the calls up (to a layer
above the caller's: a callback, e.g. a function the sender handed down).

The layers are glm_fp8's folders. Run on a checkout from before the folders (glm_fp8's modules
flat at its top), each flat module counts in the layer it moved to (``FLAT``), so that both trees
are measured by the same partition.

    python bench/scripts/layer_path.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

LAYERS = ["core", "model", "kernels", "engine", "transfer", "planning", "integrations", "testing", "cli"]
# The layer each module of the flat layout lives in now.
FLAT = {
    module: layer
    for layer, modules in {
        "core": "errors numerics _checks",
        "model": "config presets indexer models layer_plan trainer_layouts plan",
        "kernels": "reference backends jobs quantize delta delta_cut convert",
        "planning": "fleet memory update_time update_delta plan_request plan_summary plan_deployment "
        "planning plan_text plan_text_parts",
        "cli": "cli cli_args cli_plan bench demo",
    }.items()
    for module in modules.split()
}


def _layer(module: str) -> str:
    parts = module.split(".")[1:]  # without "glm_fp8"
    if not parts:
        return "top"
    return parts[0] if parts[0] in LAYERS else FLAT.get(parts[0], parts[0])


class _Trace:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.crossings: list[tuple[str, str]] = []  # (caller's module, callee's module)

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("glm_fp8.") or module == "glm_fp8":
                self.calls.append(module)
                caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
                if caller.startswith("glm_fp8.") and _layer(caller) != _layer(module):
                    self.crossings.append((caller, module))

    def run(self, fn, *args, **kwargs):
        sys.setprofile(self)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)

    def summary(self) -> dict:
        rank = {name: k for k, name in enumerate(LAYERS)}
        up = [(a, b) for a, b in self.crossings if rank.get(_layer(b), -1) > rank.get(_layer(a), -1)]
        return {
            "calls": len(self.calls),
            "modules": len(set(self.calls)),
            "layers": sorted({_layer(m) for m in self.calls}, key=lambda n: rank.get(n, -1)),
            "crossings": len(self.crossings),
            "up": len(up),
            "up_pairs": sorted({f"{a} -> {b}" for a, b in up}),
            "module_list": sorted(set(self.calls)),
        }


def _rank(rank: int, world: int) -> dict:
    import torch

    import glm_fp8
    from glm_fp8.testing import moved_layer
    from glm_fp8.transfer import DeltaOptions, Receiver, Sender

    try:  # the presets' module
        from glm_fp8.model.presets import TINY_GLM5
    except ImportError:  # glm_fp8 before its layers became folders
        from glm_fp8.models import TINY_GLM5

    config = {**TINY_GLM5, "num_nextn_predict_layers": 0}
    layer = next(i for i in range(config["num_hidden_layers"]) if i >= config.get("first_k_dense_replace", 0))
    layout = glm_fp8.EngineLayout(tp_size=1)
    kw = dict(config=config, layer_ids=[layer], engines=[None, layout], device="cpu")
    out = {}
    if rank == 0:
        sender = Sender(None, 0, delta=DeltaOptions(kept="host"), **kw)
        for step, name in enumerate(("dense", "delta")):
            trace = _Trace()
            trace.run(sender.send_model, [(layer, moved_layer(config, layer, step))])
            out[name] = trace.summary()
    else:
        receiver = Receiver(None, 0, layout=layout, delta=True, **kw)
        specs = glm_fp8.engine_param_specs(config, layout)
        params = {
            n: torch.zeros(shape, dtype=dtype)
            for n, (shape, dtype) in specs.items()
            if n.startswith(f"model.layers.{layer}.")
        }
        for name in ("dense", "delta"):
            trace = _Trace()
            trace.run(receiver.load_into, params)
            out[name] = trace.summary()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures (and each side's module list) here")
    args = parser.parse_args()
    from glm_fp8.testing import launch

    results = launch(2, _rank, (), timeout_s=300)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    if bad:
        raise SystemExit(f"a rank failed: {bad}")
    for name in ("dense", "delta"):
        for rank, side in ((0, "sender"), (1, "engine rank")):
            s = results[rank][1][name]
            print(
                f"{name:5} layer, {side:11}: {s['modules']:3} modules in {len(s['layers'])} layers "
                f"({', '.join(s['layers'])}); {s['calls']:5} calls, {s['crossings']:4} across layers, "
                f"{s['up']:3} up"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({r: v[1] for r, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
