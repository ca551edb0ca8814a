"""The options a Sender and a Receiver are built with (glm_fp8.transfer.options): one definition,
taken as an instance, a mapping or keywords, alike; every field checked in one place, before any
buffer exists, with an error naming the field and what it accepts."""

import dataclasses

import pytest
import torch

from glm_fp8.core.vocab import GATHERS, KEPT_COPIES, SCALE_FORMATS, WIRE_FORMATS, check_choice
from glm_fp8.engine.layout import EngineLayout
from glm_fp8.model.presets import TINY_GLM5
from glm_fp8.transfer import DeltaOptions, HostSinkComm, ReceiveOptions, Receiver, Sender, SendOptions


def test_an_instance_a_mapping_and_keywords_build_the_same_endpoint():
    fields = dict(config=TINY_GLM5, layer_ids=[0, 3], ring=3, device="cpu")
    built = [
        Sender(HostSinkComm(), 0, SendOptions(**fields)),
        Sender(HostSinkComm(), 0, fields),
        Sender(HostSinkComm(), 0, **fields),
        Sender(HostSinkComm(), 0, {"config": TINY_GLM5, "device": "cpu"}, layer_ids=[0, 3], ring=3),
    ]
    assert all(s.options == built[0].options for s in built)
    assert [s.payload() for s in built] == [built[0].payload()] * len(built)
    assert built[0].conv_ring.size == 3 and built[0].layer_ids == [0, 3]
    receiver = Receiver(HostSinkComm(rank=1, size=2), 0, ReceiveOptions(config=TINY_GLM5, device="cpu"))
    assert receiver.options.ring == 2 and receiver.options.delta is False


def test_every_field_has_a_docstring():
    """The options' fields are documented where they are defined (the class body's string after
    each field), as the API promises."""
    import ast
    import inspect

    import glm_fp8.transfer.options as options

    tree = ast.parse(inspect.getsource(options))
    for cls in (options.UpdateOptions, options.SendOptions, options.ReceiveOptions, options.DeltaOptions):
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
        documented = {
            a.target.id
            for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
        }
        own = {a.target.id for a in body if isinstance(a, ast.AnnAssign)}
        assert own <= documented, (cls.__name__, sorted(own - documented))


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(wire="fp16"), ValueError, r"^wire: expected one of 'fp8', 'bf16', got 'fp16'$"),
        (
            dict(scale_fmt="e8m0"),
            ValueError,
            r"^scale_fmt: expected one of None, 'fp32', 'ue8m0', got 'e8m0'$",
        ),
        (dict(gather="all"), ValueError, r"^gather: expected one of 'auto', 'full', 'chunked'"),
        (dict(ringg=2), ValueError, r"^SendOptions: unknown option\(s\) \['ringg'\]; known: \["),
        (dict(ring=0), ValueError, r"^ring: expected an integer in \[1, 16\]"),
        (dict(ring=2.0), ValueError, r"^ring: expected an integer"),
        (dict(chunk_experts=0), ValueError, r"^chunk_experts: expected an integer >= 1"),
        (dict(checksum=1), ValueError, r"^checksum: expected True or False, got 1$"),
        (dict(rest="yes"), ValueError, r"^rest: expected True or False"),
        (dict(layer_ids="0,1"), ValueError, r"^layer_ids: expected a list of layer indices, got str$"),
        (dict(engines="full"), ValueError, r"^engines: expected a list of one entry per link rank, got str$"),
        (dict(gather_dtype="bf16"), TypeError, r"^gather_dtype: expected a torch.dtype or None"),
        (dict(delta=True), TypeError, r"^delta: expected a DeltaOptions or None, got bool$"),
        (dict(delta=DeltaOptions(), wire="bf16"), ValueError, r"^delta: needs wire='fp8'"),
        (dict(delta=DeltaOptions(), checksum=False), ValueError, r"^delta: needs checksum=True"),
        (dict(config=None), ValueError, r"^config / plans: pass exactly one of them$"),
    ],
)
def test_a_bad_send_option_is_refused_naming_it(fields, error, match):
    with pytest.raises(error, match=match):
        SendOptions.of(None, {"config": TINY_GLM5, **fields})
    with pytest.raises(error, match=match):  # the same check through the constructor
        Sender(HostSinkComm(), 0, **{"config": TINY_GLM5, "device": "cpu", **fields})


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(ring=1), ValueError, r"^ring: expected an integer in \[2, 16\] buffers"),
        (dict(layout="tp2"), TypeError, r"^layout: expected an EngineLayout or None, got str$"),
        (dict(layout=EngineLayout(), wire="bf16"), ValueError, r"^layout: a sharded engine needs config="),
        (dict(max_manifest_bytes=0), ValueError, r"^max_manifest_bytes: expected an integer in \[1, "),
        (dict(delta="yes"), ValueError, r"^delta: expected True or False, got 'yes'$"),
        (dict(gather="full"), ValueError, r"^ReceiveOptions: unknown option\(s\) \['gather'\]"),
    ],
)
def test_a_bad_receive_option_is_refused_naming_it(fields, error, match):
    with pytest.raises(error, match=match):
        ReceiveOptions.of(None, {"config": TINY_GLM5, **fields})


def test_options_are_frozen_and_a_bad_options_argument_is_refused():
    opts = SendOptions(config=TINY_GLM5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.ring = 4  # type: ignore[misc]
    with pytest.raises(
        TypeError, match=r"^options: expected a SendOptions, a mapping of its fields or None, got list"
    ):
        SendOptions.of([("ring", 2)], {})
    # A ReceiveOptions is not a SendOptions: its fields are not a sender's.
    with pytest.raises(TypeError, match="options: expected a SendOptions"):
        SendOptions.of(ReceiveOptions(config=TINY_GLM5), {})


def test_delta_options():
    assert DeltaOptions().kept == "gpu" and DeltaOptions(kept="host", resync_every=4).resync_every == 4
    with pytest.raises(ValueError, match=r"^delta.kept: expected one of 'gpu', 'host', got 'disk'$"):
        DeltaOptions(kept="disk")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="resync_every expected None or an integer >= 1"):
            DeltaOptions(resync_every=bad)
    assert DeltaOptions().graphs is True and DeltaOptions(graphs=False).graphs is False
    with pytest.raises(ValueError, match=r"^delta.graphs: expected True or False, got 1$"):
        DeltaOptions(graphs=1)


def test_the_vocabularies_and_their_one_check():
    assert WIRE_FORMATS == ("fp8", "bf16") and SCALE_FORMATS == ("fp32", "ue8m0")
    assert KEPT_COPIES == ("gpu", "host") and "quantize_then_gather" in GATHERS
    assert check_choice("wire", "bf16", WIRE_FORMATS) == "bf16"
    assert check_choice("scale_fmt", None, SCALE_FORMATS, also=(None,)) is None
    with pytest.raises(ValueError, match=r"^x: expected one of 'auto', 'fp8', 'bf16', got 3$"):
        check_choice("x", 3, WIRE_FORMATS, also=("auto",))
    with pytest.raises(ValueError):
        check_choice("wire", torch.float8_e4m3fn, WIRE_FORMATS)


@pytest.mark.parametrize(
    "holders, match",
    [
        ([0, 1], "holders: expected a mapping"),
        ({0: []}, r"holders\[0\]: expected at least one"),
        ({0: [0, 0]}, "named twice"),
        ({0: "01"}, "expected a list of link ranks"),
        ({-2: [0]}, "a layer index"),
    ],
)
def test_bad_holders_are_refused_naming_them(holders, match):
    with pytest.raises(ValueError, match=match):
        SendOptions(config=TINY_GLM5, holders=holders)


def test_holders_split_a_stage_s_layers_among_its_senders_only():
    """Pipeline stages: senders 0, 1 hold layers 0..1, senders 2, 3 layers 2..3 and the MTP layer;
    each layer's experts are split among its holders in their order and its other entries owned by
    one of them; a sender sends nothing of a layer it does not hold. Holders that name a rank which
    is not a sender, or a layer outside the update, are refused before anything moves."""
    from glm_fp8.model.families import model_layer_ids
    from glm_fp8.model.trainer_layouts import layer_prefix
    from glm_fp8.transfer.pack import FULL

    ids = model_layer_ids(TINY_GLM5)
    holders = {i: ([0, 1] if i < 2 else [3, 2]) for i in ids}
    kw = dict(
        config=TINY_GLM5, layer_ids=ids, device="cpu", senders=[0, 1, 2, 3], engines=[None] * 4 + [FULL]
    )
    sender = Sender(HostSinkComm(rank=0, size=5), 0, holders=holders, **kw)
    routes = sender.routes
    for pos, i in enumerate(ids):
        lay, held = routes.layers[pos], holders[i]
        for name, rows in lay.splits.items():
            if name.endswith("w13_weight"):  # 4 experts: two each, in the holders' order
                assert [rows[t] for t in held] == [(0, 2), (2, 4)], (name, rows)
            assert all(rows[t] == (0, 0) for t in range(4) if t not in held), (name, rows)
        assert set(lay.owners.values()) <= set(held), lay.owners
        assert all(lay.sent_nbytes(t) == 0 for t in range(4) if t not in held)
        assert all(not lay.local_plans[t].entries for t in range(4) if t not in held)
        assert all(name.startswith(layer_prefix(i)) for name in lay.owners)
    other = Sender(HostSinkComm(rank=0, size=5), 0, **kw)  # every sender holds every layer
    assert other.payload() != sender.payload()  # the holders are part of the agreed manifest
    with pytest.raises(ValueError, match=r"holders\[2\]: link rank 4 is not a sender"):
        Sender(HostSinkComm(rank=0, size=5), 0, holders={2: [4]}, **kw)
    with pytest.raises(ValueError, match="holders: layer 9 is not in the update"):
        Sender(HostSinkComm(rank=0, size=5), 0, holders={9: [0]}, **kw)
