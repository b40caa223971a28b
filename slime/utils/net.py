"""Addresses of this node: its IP as the cluster sees it, and a free TCP port (one home for both)."""

from __future__ import annotations

import random
import socket


def node_ip() -> str:
    """This node's IP as Ray reports it when this process is part of a Ray cluster, else loopback (a process
    outside Ray talks only to processes on its own machine)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


# Ports handed out below Linux's ephemeral range (ip_local_port_range, 32768-60999 by default), where the kernel
# picks the local ports of outgoing connections: a port found free there can be taken by any connection before
# its server binds it. Ray's workers listen on 10002-19999 by default; this range stays above that.
PORT_RANGE = (20000, 32768)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high + 1
    except (OSError, ValueError):
        return 32768, 61000


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on right now at `host` (all interfaces for "" or 0.0.0.0), outside the kernel's
    ephemeral range (PORT_RANGE) so no outgoing connection takes it meanwhile. Another server may still take it
    before the caller binds it: callers that start servers retry on "address already in use"; a caller that can
    bind at once should bind port 0 itself (torch's TCPStore does: slime/backends/training/actor.py)."""
    host = host if host not in ("", "0.0.0.0") else ""
    low, high = PORT_RANGE
    e_low, e_high = _ephemeral_range()
    candidates = [p for p in range(low, high) if not e_low <= p < e_high]
    # not the module's generator: runs seed it (random.seed), and two processes seeded alike would pick alike
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: any port the kernel gives
        s.bind((host, 0))
        return s.getsockname()[1]


def listener_pids(port: int) -> set[int]:
    """The processes listening on TCP `port` on this machine (any address), as far as this process may see them
    (pids of other users' processes can be hidden: those are left out)."""
    import psutil

    return {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid is not None}
