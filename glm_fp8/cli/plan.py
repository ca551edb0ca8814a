"""``glm-fp8 plan``'s command: the config (``--model``, ``--config``, or a ``--fleet`` preset's
model), the ``PlanRequest`` its options describe (one engine layout, ``--server`` specs or a
``--fleet`` preset) and the delta update to predict beside it (``--delta``, its options:
``add_delta_arguments``), the report printed as text or JSON; every refusal is argparse's error
naming the option. glm_fp8 is imported lazily, as everywhere in the CLI (the kernels must not load before
the CLI picks Triton's interpreter)."""

from __future__ import annotations

import argparse
import json


def load_config_arg(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The --config file or the --model preset (default: the --fleet preset's model, else glm-5),
    validated (``glm_fp8.model.config.as_config``); argparse errors for what cannot be read or used."""
    from glm_fp8.model.presets import FLEETS, PRESETS, load_config

    if args.model is None:  # the fleet's model unless --model or --config says otherwise
        args.model = FLEETS[args.fleet]["model"] if getattr(args, "fleet", None) else "glm-5"
    if not args.config:
        if args.model not in PRESETS:
            parser.error(
                f"argument --model: unknown preset {args.model!r} "
                f"(expected one of: {', '.join(sorted(PRESETS))})"
            )
        return load_config(args.model)
    try:
        return load_config(config_path=args.config)
    except ValueError as e:
        parser.error(f"argument --config: {str(e).removeprefix('config: ')}")


# PlanRequest fields -> the options that set them, for errors.
_OPTIONS = {
    "trainer_gpus": "--trainer-gpus",
    "trainer": "--trainer",
    "engines": "--engines",
    "engine_tp": "--engine-tp",
    "engine_dp": "--engine-dp",
    "link_gbps": "--link-gbps",
    "gpu_gib": "--gpu-gib",
    "target": "--target",
    "master_dtype": "--master-dtype",
    "gather_dtype": "--gather-dtype",
    "scale_fmt": "--scale-fmt",
    "servers": "--server",
    "delta": "--delta",
}


def add_delta_arguments(p: argparse.ArgumentParser) -> None:
    """``glm-fp8 plan``'s delta options (send only what changed)."""
    from glm_fp8.cli.args import fraction  # lazy, as the CLI's every glm_fp8 import

    p.add_argument(
        "--delta",
        type=fraction,
        metavar="FRACTION",
        help="also predict a delta update (only the changed fp8 bytes and scales travel) of each fp8 "
        "strategy, FRACTION of the e4m3 bytes changed per step, with --trainer-gpus: its time beside "
        "the dense one, its wire bytes, a sender's kept copy and each server's receiver; measured "
        "median steps (bench/RESULTS.md): 0.0012 at lr 1e-6, 0.0031 at 3e-6, 0.009 at 1e-5 (default: none)",
    )
    p.add_argument(
        "--delta-kept",
        choices=["gpu", "host"],
        help="with --delta: where each sender keeps what it last sent: gpu, or host (pinned memory "
        "the comparison reads and writes in place over PCIe) (default: gpu)",
    )
    p.add_argument(
        "--delta-scales",
        type=fraction,
        metavar="FRACTION",
        help="with --delta: the fraction of block scales changed per step: fp32 scales from fp32 masters "
        "nearly all change, UE8M0 scales did not (default: 1)",
    )
    p.add_argument(
        "--delta-passthrough",
        type=fraction,
        metavar="FRACTION",
        help="with --delta: the fraction of the passthrough (bf16, fp32) entries' bytes changed, sent "
        "as deltas too (default: they go dense)",
    )


def _delta(args: argparse.Namespace, parser: argparse.ArgumentParser, trainer_gpus: int | None):
    """The ``Delta`` the options describe, or None; argparse errors for delta options without
    --delta and for --delta without a deployment."""
    from glm_fp8.planning.update_delta import Delta

    given = (
        ("--delta-kept", args.delta_kept),
        ("--delta-scales", args.delta_scales),
        ("--delta-passthrough", args.delta_passthrough),
    )
    if args.delta is None:
        for flag, value in given:
            if value is not None:
                parser.error(f"argument {flag}: describes a delta update and needs --delta FRACTION")
        return None
    if trainer_gpus is None:
        parser.error(
            "argument --delta: a delta update is predicted for a deployment and needs "
            "--trainer-gpus N (or --nodes, or --fleet)"
        )
    scales = 1.0 if args.delta_scales is None else args.delta_scales
    return Delta(args.delta, scales, args.delta_kept or "gpu", args.delta_passthrough)


def plan_request_of(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The ``PlanRequest`` the options describe; argparse errors for flags that would be ignored
    or that contradict each other."""
    from glm_fp8.planning.request import GATHER_DTYPES, MASTER_DTYPES, MAX_TRAINER_GPUS, PlanRequest

    trainer_gpus = args.trainer_gpus
    if args.gpus_per_node is not None and args.nodes is None:
        parser.error(f"argument --gpus-per-node: {args.gpus_per_node} needs --nodes (the trainer's nodes)")
    if args.nodes is not None:
        world = args.nodes * (args.gpus_per_node or 8)
        if world > MAX_TRAINER_GPUS:
            parser.error(
                f"argument --nodes: {args.nodes} x --gpus-per-node {args.gpus_per_node or 8} = "
                f"{world} trainer GPUs; expected at most {MAX_TRAINER_GPUS} (the many senders' plan "
                "is computed per sender)"
            )
        if trainer_gpus is not None and trainer_gpus != world:
            parser.error(
                f"argument --trainer-gpus: {trainer_gpus} contradicts --nodes {args.nodes} x "
                f"--gpus-per-node {args.gpus_per_node or 8} = {world} trainer GPUs; give "
                "--trainer-gpus or --nodes, or make them agree"
            )
        trainer_gpus = world
    servers, link_gbps = tuple(args.server or ()), args.link_gbps
    trainer = None
    if args.trainer is not None:
        from glm_fp8.planning.fleet import MegatronTrainer

        try:
            trainer = MegatronTrainer.parse(args.trainer)
        except ValueError as e:
            parser.error(f"argument --trainer: {e}")
    if args.fleet is not None:
        from glm_fp8.planning.fleet import fleet_preset

        if servers:
            parser.error(
                f"argument --server: --fleet {args.fleet} gives the servers; give --fleet or --server"
            )
        fleet = fleet_preset(args.fleet)
        # the preset's trainer and NIC unless the options say otherwise
        trainer_gpus = trainer_gpus or fleet.trainer_gpus
        link_gbps = link_gbps or fleet.link_gbps
        servers = fleet.servers
        trainer = trainer or fleet.trainer
    if trainer is not None and trainer_gpus is None:
        parser.error("argument --trainer: describes the deployment and needs --trainer-gpus N (or --nodes)")
    if servers:
        which = f"--fleet {args.fleet}" if args.fleet else "--server"
        one = (
            ("--engines", args.engines),
            ("--engine-tp", args.engine_tp),
            ("--engine-dp", args.engine_dp),
            ("--engine-ep", args.engine_ep or None),
        )
        for flag, value in one:
            if value is not None:
                parser.error(
                    f"argument {flag}: one engine layout; {which} gives each server its own (--server "
                    "tp=..,dp=..,ep,replicas=..): give one or the other"
                )
    if trainer_gpus is None:
        for flag, value in (
            ("--server", args.server),
            ("--engines", args.engines),
            ("--link-gbps", args.link_gbps),
            ("--experts-split", args.experts_split or None),
            ("--gpu-gib", args.gpu_gib),
        ):
            if value is not None:
                parser.error(
                    f"argument {flag}: describes the deployment and needs --trainer-gpus N (or "
                    "--nodes): without it there is no update to predict"
                )
    for flag, value in (("--engine-dp", args.engine_dp), ("--engine-ep", args.engine_ep or None)):
        if value is not None and args.engine_tp is None:
            parser.error(
                f"argument {flag}: needs --engine-tp (the engine's layout is TP x DP, experts by "
                "EP or MoE TP)"
            )
    given = {
        "engines": args.engines,
        "engine_dp": args.engine_dp,
        "link_gbps": link_gbps,
        "gpu_gib": args.gpu_gib,
    }
    return PlanRequest(
        target=args.target,
        scale_fmt=args.scale_fmt,
        master_dtype=MASTER_DTYPES[args.master_dtype],
        gather_dtype=GATHER_DTYPES[args.gather_dtype],
        trainer_gpus=trainer_gpus,
        engine_tp=args.engine_tp,
        engine_ep=args.engine_ep,
        experts_whole=not args.experts_split,
        entries=args.entries,
        servers=servers,
        trainer=trainer,
        **{k: v for k, v in given.items() if v is not None},  # the rest: PlanRequest's defaults
    )


def plan_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from glm_fp8.core.errors import PlanArgumentError
    from glm_fp8.planning.report import plan_report
    from glm_fp8.planning.text import format_plan_report

    config = load_config_arg(args, parser)
    request = plan_request_of(args, parser)
    delta = _delta(args, parser, request.trainer_gpus)
    try:
        report = plan_report(config, request, delta)
    except PlanArgumentError as e:
        option = _OPTIONS.get(e.argument, e.argument)
        if e.argument == "servers" and args.fleet:
            option = "--fleet"
        if e.argument == "config":
            option = "--config" if args.config else f"--model {args.model!r}"
        if e.argument == "trainer_gpus" and args.nodes is not None and args.trainer_gpus is None:
            option = "--nodes"
        parser.error(f"argument {option}: {e.message}")
    except (KeyError, ValueError) as e:  # a config as_config accepts that the plans read two ways
        if not args.config:
            raise
        parser.error(f"argument --config: {args.config!r} is not a usable config: {e}")
    if args.json:
        from glm_fp8 import __version__

        print(json.dumps({"glm_fp8_version": __version__, **report}, indent=1))
        return 0
    print(format_plan_report(report, args.detail))
    return 0


__all__ = ["add_delta_arguments", "load_config_arg", "plan_command", "plan_request_of"]
