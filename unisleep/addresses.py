"""Network addresses, as every layer needs them the same way (Core: no vendor, no engine)."""

from __future__ import annotations

from typing import Optional


def is_loopback(host: Optional[str]) -> bool:
    """``host`` (a name or an IPv4/IPv6 literal, brackets and a zone allowed) is this machine's
    loopback: ``localhost``, 127.0.0.0/8, ``::1`` or an IPv4-mapped ``::ffff:127.x``."""
    import ipaddress

    if not host:
        return False
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(h.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))
