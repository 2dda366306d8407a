"""Whether a host name means this machine's loopback interface: one answer for the launcher,
the rank runtime and the rendezvous, which all decide from it whether to bind 127.0.0.1."""

from __future__ import annotations

import ipaddress
import socket

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain")


def is_loopback(host: str, resolve: bool = False) -> bool:
    """True for a loopback name or address ("localhost", 127.0.0.0/8, "::1", "[::1]").
    ``resolve`` also looks the name up, so a hostname that /etc/hosts maps to 127.0.1.1 (as
    Debian does for the machine's own name) counts: right where the name is only used to reach
    this machine, wrong where other hosts must reach it by that name."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not resolve:
        return False
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def all_loopback(hosts: list[str]) -> bool:
    """True when every host is a loopback name, so the control plane may bind 127.0.0.1."""
    return all(is_loopback(h) for h in hosts)
