"""The address servers that other nodes must reach listen on (the workers' rendezvous, the
engines' HTTP servers): 127.0.0.1 on a one-node cluster, so nothing listens beyond loopback
there, and this node's cluster address (`ray start --node-ip-address`) when there are several.
(Ray itself registers a `ray start` node given 127.0.0.1 under the machine's outside address,
so the node's address alone would not keep a local cluster on loopback.) Also what devices an
actor on a node sees (`device_options`)."""

from __future__ import annotations

import contextlib
import random
import socket
import sys
from pathlib import Path


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


def device_options(num_gpus: float) -> dict:
    """Ray actor options for an actor of `num_gpus` GPUs. Ray leaves an actor that asks for none
    every GPU of its node (CUDA_VISIBLE_DEVICES untouched): two train ranks both took device 0
    (nccl refuses that) and engines would pile onto it. On a cluster with GPUs (when the actor
    starts: a GPU node an autoscaler adds later is not foreseen) such an actor sees none, so it
    runs on the host as asked. On GPU-less clusters the options are Ray's plain ones."""
    import ray

    if num_gpus or not ray.cluster_resources().get("GPU", 0):
        return {"num_gpus": num_gpus}
    return {"num_gpus": 0, "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (free_ports' pick)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> list[int]:
    """`n` distinct ports nothing listens on at `host` now, none of them in `avoid` (ports a
    caller already gave out), drawn at random below the OS's ephemeral range. A port is free
    only until someone binds it: one from the ephemeral range (bind to port 0) can also go to
    any outgoing connection or another process's port-0 bind before the server starts (under
    `pytest -n 2` a local head's dashboard port was taken so); below the range only an explicit
    bind competes. Every socket stays bound until all are picked: one call never repeats a port.
    Drawn from the OS's entropy, not `random`'s seeded state: two processes that seeded it
    alike would draw alike."""
    high = _ephemeral_low() - 1
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        while len(ports) < n:
            # the OS's pick where the range leaves too little room below it
            port = _draw.randint(PICK_FROM, high) if high - PICK_FROM >= 1000 else 0
            if port in avoid or port in ports:
                continue
            s = held.enter_context(socket.socket())
            try:
                s.bind((host, port))
            except OSError:  # in use: draw again
                continue
            port = s.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
    return ports


# Ray's worker processes take 10002-19999 by default: picks start above them.
PICK_FROM = 20000
_draw = random.SystemRandom()


def _ephemeral_low() -> int:
    """The first port of the OS's ephemeral range (Linux: /proc; elsewhere the IANA 49152)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def ray_bin() -> str:
    """The `ray` command of this Python environment."""
    return str(Path(sys.executable).with_name("ray"))
