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


def family_of(host: str) -> socket.AddressFamily:
    """The socket family of an address literal (IPv4 for a name: resolve it first where that matters)."""
    return socket.AF_INET6 if is_ipv6(host) else socket.AF_INET


def route_addr(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host:port``: the source address of the
    kernel's route there, in the family ``host`` resolves to (no packet is sent). Falls back to
    the address the host name resolves to when no route is known."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        found = []
    for family, _, _, _, target in found:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(target)
                return str(s.getsockname()[0])
        except OSError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
