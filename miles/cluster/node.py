"""The address servers that other nodes must reach listen on (the workers' rendezvous, the
engines' HTTP servers): 127.0.0.1 on a one-node cluster, so nothing listens beyond loopback
there, and this node's cluster address (`ray start --node-ip-address`) when there are several.
(Ray itself registers a `ray start` node given 127.0.0.1 under the machine's outside address,
so the node's address alone would not keep a local cluster on loopback.)"""

from __future__ import annotations

import contextlib
import socket


def node_address() -> str:
    """Inside a Ray worker or driver: loopback when the cluster has one node, else this node's
    IP. Outside Ray (or where Ray is not installed: a lone GPU box running a benchmark): 127.0.0.1."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    if not ray.is_initialized() or sum(n["Alive"] for n in ray.nodes()) < 2:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (the OS's pick)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> list[int]:
    """`n` distinct ports nothing listens on at `host` now, none of them in `avoid` (ports a
    caller already gave out). Every socket stays bound until all are picked: one at a time, the
    OS may hand the same port out twice (a Ray head once got its GCS and client-server ports
    equal and refused to start)."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < n:
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return ports
