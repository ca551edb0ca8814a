"""glm_fp8.testing's rendezvous ports: a test's own ports and its launcher's are never the same.

Invariant: ``free_ports`` hands out distinct ports, each free when drawn, below the kernel's
ephemeral range, and never a port this process handed out before (``launch`` draws its world's
port after the test drew its own: a port drawn twice would give two stores one address)."""

import socket

from glm_fp8.testing import free_port, free_ports


def test_no_port_is_handed_out_twice_in_one_process():
    drawn = [*free_ports(5), free_port(), *free_ports(3)]
    assert len(set(drawn)) == len(drawn) == 9
    for port in drawn:  # each free now: a store could listen on it
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        floor = int(f.read().split()[0])
    assert all(20000 <= p < min(32768, floor) for p in drawn), drawn
