"""Network addresses, as every layer needs them the same way (Core: no vendor, no engine)."""

from __future__ import annotations


def is_loopback(host: str) -> bool:
    """``host`` (a name or an IPv4/IPv6 literal) is this machine's loopback: ``localhost``,
    127.0.0.0/8 or ``::1``."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
