"""Addresses of this node: its IP as the cluster sees it, and a free TCP port (one home for both)."""

from __future__ import annotations

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


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on right now at `host` (all interfaces for "" or 0.0.0.0). Another process may
    take it before the caller binds it: callers that start servers retry on "address already in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "", 0))
        return s.getsockname()[1]
