"""Test harness: several hosts on one machine, as network namespaces joined by a bridge.

Each host is a network namespace (``ip netns``) with one veth pair onto a bridge in the root
namespace, an IPv4 address (``10.<a>.<b>.<i>/24``) and an IPv6 one (``fd<a>:<b>::<i>/64``). The
root namespace holds ``.254`` / ``::fe`` on the bridge, so the test itself reaches every host
(``rlaunch status``, etcd's health). A process runs on a host through :meth:`Hosts.argv`
(``ip netns exec``); it sees the host's interfaces only, while sharing the machine's files. A host
can get more interfaces: one whose default route leads to no other host
(:meth:`Hosts.add_interface`), or one on a second network that joins some hosts alone, a
management network say (:meth:`Hosts.add_network`).

Faults are real networking:

- :meth:`Hosts.link_down`: the host's cable is pulled (its veth goes down, nothing passes);
- :meth:`Hosts.cut`: iptables inside the host's namespace drops every packet to and from the
  given addresses, in both directions (a partition between those hosts only), or in one
  (``direction="out"``: the host's packets to them are lost, theirs still arrive);
- :meth:`Hosts.shape`: a tbf qdisc limits the host's bandwidth, both ways (the kernel here has
  no netem, so no latency is added);
- :meth:`Hosts.heal`: every cut is removed.

Every name carries a random id, so harnesses never share a namespace, bridge or subnet.
:meth:`Hosts.close` kills whatever still runs in the namespaces and deletes them, the veths and
the bridge; the ``hosts`` fixture calls it even when the test fails. Needs root, ``ip`` and
``iptables`` (``.ci/run`` installs iptables).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import uuid
from collections.abc import Sequence


def _run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _v6(addr: str) -> str:
    """An IPv6 address as the kernel and rlaunch write it (``fd0a:09:0::1`` is ``fd0a:9::1``)."""
    return str(ipaddress.IPv6Address(addr))


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as ``10gbit`` or ``500mbit``."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"The link rate {rate!r} is not valid: write it as tc does, for example 10gbit or 500mbit.")


class Host:
    """One namespace: its name, its interface and its addresses."""

    def __init__(self, harness: str, index: int, v4: str, v6: str) -> None:
        self.index = index
        self.name = f"rl{harness}h{index}"  # the namespace
        self.veth = f"v{harness}h{index}"  # its root end, on the bridge (at most 15 characters)
        self.v4 = v4
        self.v6 = v6
        self.interfaces = ["eth0"]

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.v4}, {self.v6})"

    def addr(self, family: int = 4) -> str:
        return self.v4 if family == 4 else self.v6


class Hosts:
    """``count`` hosts on one bridge; more networks on demand (:meth:`add_interface`, :meth:`add_network`)."""

    def __init__(self, count: int, ipv4: bool = True) -> None:
        self.ipv4 = ipv4  # False: IPv6-only hosts (no IPv4 address but loopback)
        self.id = uuid.uuid4().hex[:5]
        a, b = int(self.id[:2], 16), int(self.id[2:4], 16)
        self._v4 = f"10.{a}.{b}"
        self._v6 = f"fd{a:02x}:{b:02x}:{self.id[4]}"
        self.bridge = f"rb{self.id}"
        self.hosts = [Host(self.id, i, f"{self._v4}.{i + 1}", _v6(f"{self._v6}::{i + 1:x}")) for i in range(count)]
        self.root_v4 = f"{self._v4}.254"
        self.root_v6 = _v6(f"{self._v6}::fe")
        self._extra_bridges: list[str] = []
        self._made: list[Host] = []

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def start(self) -> Hosts:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        if self.ipv4:
            _run("ip", "addr", "add", f"{self.root_v4}/24", "dev", self.bridge)
        _run("ip", "-6", "addr", "add", f"{self.root_v6}/64", "dev", self.bridge, "nodad")
        _run("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            self._made.append(host)
            _run("ip", "netns", "add", host.name)
            ns = ("ip", "netns", "exec", host.name)
            _run(*ns, "ip", "link", "set", "lo", "up")
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
            _run("ip", "link", "set", host.veth, "master", self.bridge, "up")
            if self.ipv4:
                _run(*ns, "ip", "addr", "add", f"{host.v4}/24", "dev", "eth0")
            _run(*ns, "ip", "-6", "addr", "add", f"{host.v6}/64", "dev", "eth0", "nodad")
            _run(*ns, "ip", "link", "set", "eth0", "up")
        return self

    def add_interface(self, host: Host) -> str:
        """Give ``host`` a second interface (``eth<n>``) on a network of its own, which reaches no
        other host, and make it the host's default route: its address, as :meth:`addr` of it."""
        net = f"172.{16 + host.index}.{int(self.id[:2], 16)}"
        bridge = self._bridge(f"rb{self.id}x{host.index}")
        interface = self._plug(host, bridge, f"v{self.id}h{host.index}x", f"{net}.1")
        _run("ip", "netns", "exec", host.name, "ip", "route", "add", "default", "via", f"{net}.254", "dev", interface)
        return f"{net}.1"

    def add_network(self, members: Sequence[Host]) -> list[str]:
        """A second network (a management network, say) joining ``members`` alone: each gets an
        interface (``eth<n>``) on a bridge of its own, and nothing routes between it and the first
        network, so a host not on it cannot reach these addresses. Their addresses on it, in order."""
        k = len(self._extra_bridges)
        net = f"172.{24 + k % 8}.{int(self.id[:2], 16)}"
        bridge = self._bridge(f"rb{self.id}n{k}")
        addrs = [f"{net}.{h.index + 1}" for h in members]
        for host, addr in zip(members, addrs, strict=True):
            self._plug(host, bridge, f"v{self.id}h{host.index}n{k}", addr)
        return addrs

    def _bridge(self, name: str) -> str:
        _run("ip", "link", "add", name, "type", "bridge")
        self._extra_bridges.append(name)
        _run("ip", "link", "set", name, "up")
        return name

    def _plug(self, host: Host, bridge: str, veth: str, v4: str) -> str:
        """A new interface of ``host`` on ``bridge``, with the address ``v4``/24: its name."""
        interface = f"eth{len(host.interfaces)}"
        ns = ("ip", "netns", "exec", host.name)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", interface, "netns", host.name)
        _run("ip", "link", "set", veth, "master", bridge, "up")
        _run(*ns, "ip", "addr", "add", f"{v4}/24", "dev", interface)
        _run(*ns, "ip", "link", "set", interface, "up")
        host.interfaces.append(interface)
        return interface

    # -- processes ----------------------------------------------------------------------------

    @staticmethod
    def argv(host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host`` (in its namespace)."""
        return ["ip", "netns", "exec", host.name, *argv]

    def route(self, host: Host, addr: str) -> str:
        """What ``host``'s kernel says of its route to ``addr`` (``ip route get``: the interface, the source)."""
        return _run("ip", "netns", "exec", host.name, "ip", "route", "get", addr)

    # -- faults -------------------------------------------------------------------------------

    def link_down(self, host: Host) -> None:
        _run("ip", "link", "set", host.veth, "down")

    def link_up(self, host: Host) -> None:
        _run("ip", "link", "set", host.veth, "up")

    def cut(self, host: Host, peers: Sequence[str], direction: str = "both") -> None:
        """Drop ``host``'s packets to ``peers`` (addresses), and theirs to it unless ``direction`` is ``out``."""
        for peer in peers:
            tool = "ip6tables" if ipaddress.ip_address(peer).version == 6 else "iptables"
            ns = ("ip", "netns", "exec", host.name, tool)
            _run(*ns, "-A", "OUTPUT", "-d", peer, "-j", "DROP")
            if direction == "both":
                _run(*ns, "-A", "INPUT", "-s", peer, "-j", "DROP")

    def heal(self, host: Host) -> None:
        """Remove every cut of ``host``."""
        for tool in ("iptables", "ip6tables"):
            for chain in ("INPUT", "OUTPUT"):
                _run("ip", "netns", "exec", host.name, tool, "-F", chain)

    def shape(self, host: Host, rate: str) -> str:
        """Limit ``host``'s link to ``rate`` (tc's notation: ``1gbit``) both ways; the qdisc used.

        The bucket holds 10 ms at the rate (tbf cannot reach a rate whose bucket is smaller than
        what one kernel tick lets through)."""
        burst = max(64 * 1024, int(rate_bytes(rate) / 100))
        qdisc = ("tbf", "rate", rate, "burst", str(burst), "latency", "50ms")
        _run("ip", "link", "set", host.veth, "txqueuelen", "10000")
        _run("tc", "qdisc", "replace", "dev", host.veth, "root", *qdisc)
        _run("ip", "netns", "exec", host.name, "tc", "qdisc", "replace", "dev", "eth0", "root", *qdisc)
        return " ".join(qdisc)

    # -- teardown -----------------------------------------------------------------------------

    def pids(self, host: Host) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def close(self) -> list[tuple[str, int]]:
        """Kill what still runs on the hosts and remove everything; the processes killed, by host."""
        killed = []
        for host in self._made:
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append((host.name, pid))
        for host in self._made:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
        for link in (self.bridge, *self._extra_bridges):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        return killed
