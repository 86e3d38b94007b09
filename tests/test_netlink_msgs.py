"""A port's plug messages are copied from a shape pyroute2 encoded once (with marker
values) and filled in: they must be, byte for byte, what pyroute2 encodes for that port."""

from __future__ import annotations

import random

from branchbox.runtime import netlink_msgs as msgs


def test_a_filled_shape_is_what_pyroute2_encodes_for_that_port() -> None:
    rng = random.Random(12)
    for _ in range(500):
        name = "bv" + "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(1, 12)))
        mac = "02:" + ":".join(f"{rng.randrange(256):02x}" for _ in range(5))
        address = f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
        gateway, prefix = f"10.{rng.randrange(256)}.0.1", rng.choice([8, 16, 20, 24, 30])
        bridge = rng.randrange(1, 1 << 20)
        whole = msgs.PlugMessages(msgs.veth(name, bridge, mac),
                                  msgs.configure(msgs.PEER_INDEX, address, prefix, gateway),
                                  bridge)
        assert msgs.plug_messages(name, mac, address, prefix, gateway, bridge) == whole


def test_a_gateway_that_is_the_marker_is_encoded_whole() -> None:
    """The address marker occurring elsewhere (here: as the gateway) must not be filled in."""
    marker = msgs._ADDR_MARK
    got = msgs.plug_messages("bv1", "02:00:00:00:00:01", "10.0.0.5", 24, marker, 3)
    assert got.inside == msgs.configure(msgs.PEER_INDEX, "10.0.0.5", 24, marker)
