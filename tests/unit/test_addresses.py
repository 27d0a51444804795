"""Addresses as rlaunch writes and picks them (IPv4 and IPv6)."""

from __future__ import annotations

from rlaunch.addresses import host_port, is_ipv6, route_addr
from rlaunch.store.client import parse_endpoints


def test_ipv6_literals_are_bracketed_and_parse_back() -> None:
    assert host_port("fd00::1", 2379) == "[fd00::1]:2379"
    assert host_port("10.0.0.1", 2379) == "10.0.0.1:2379"
    assert host_port("etcd-a", 2379) == "etcd-a:2379"
    assert is_ipv6("fe80::1%eth0") and not is_ipv6("etcd-a")
    (ep,) = parse_endpoints("http://[fd00::1]:2379")
    assert (ep.host, ep.port, str(ep)) == ("fd00::1", 2379, "[fd00::1]:2379")


def test_the_route_source_address_is_of_the_targets_family() -> None:
    assert route_addr("127.0.0.1", 2379) == "127.0.0.1"
    assert route_addr("::1", 2379) == "::1"
