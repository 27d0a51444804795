"""Network addresses as rlaunch writes and picks them, IPv4 and IPv6 alike (pure, but for
:func:`route_addr`, which asks the kernel for a route and sends no packet)."""

from __future__ import annotations

import ipaddress
import socket


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets (``[fd00::1]:2379``), as URLs and gRPC take it."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.split("%")[0]), ipaddress.IPv6Address)
    except ValueError:
        return False


def route_addr(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host:port``: the source address of the
    kernel's route there, in the family ``host`` resolves to (no packet is sent). Falls back to
    the address the host name resolves to when no route is known."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
