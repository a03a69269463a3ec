"""A transfer group's rendezvous: ``tcp://HOST:PORT`` parsed, and rank 0's listening socket bound
to exactly that address (a loopback rendezvous listens on loopback only; docs/security.md)."""

from __future__ import annotations

import socket
from typing import Optional
from urllib.parse import urlparse

from ..errors import InvalidArgumentError


def parse_rendezvous(rendezvous: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (host, port)."""
    u = urlparse(rendezvous if "://" in rendezvous else f"tcp://{rendezvous}")
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or not port:
        raise InvalidArgumentError(f"rendezvous must look like tcp://HOST:PORT, got {rendezvous!r}")
    return u.hostname, int(port)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on exactly ``host:port`` (not on every interface)."""
    infos = socket.getaddrinfo("127.0.0.1" if host == "localhost" else host, port, type=socket.SOCK_STREAM)
    err: Optional[OSError] = None
    for family, kind, proto, _name, addr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(128)
            s.set_inheritable(False)
            return s
        except OSError as e:
            s.close()
            err = e
    raise OSError(f"cannot listen on {host}:{port}: {err}")
