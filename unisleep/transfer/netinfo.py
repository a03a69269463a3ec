"""What this machine says about a socket, to name who or what is behind a failure: who is at the
other end of a local TCP connection, from ``/proc/net/tcp{,6}`` (Linux: the uid that owns a socket
is listed there for every socket of this network namespace, so a connection made from this machine
can be named, "uid 65534 (nobody)", in an intrusion; connections from another machine are named by
address only); the boot and the network and process namespaces this process runs in (two group
members share a machine, and see each other's processes, when theirs match); and running out of
file descriptors, said as a :class:`~unisleep.errors.DescriptorLimitError` that names the limit
and the fix."""

from __future__ import annotations

import errno
import os
import socket
from typing import Iterable, Optional

from ..errors import DescriptorLimitError

_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "0A": "LISTEN"}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _netns() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _hex_addr(h: str) -> str:
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i: i + 4][::-1] for i in range(0, 16, 4))
    ip = socket.inet_ntop(socket.AF_INET6, words)
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def _norm(ip: str) -> str:
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def tcp_table(remote_ports: Optional[Iterable[int]] = None) -> list[tuple[str, int, str, int, str, int, str]]:
    """(local ip, local port, remote ip, remote port, state, uid, inode) of every TCP socket of this
    network namespace; with ``remote_ports``, only (at least) those connected or connecting to one
    of them — a quick pass for a table a flood made long."""
    tags = tuple(f":{p:04X} " for p in remote_ports) if remote_ports is not None else None
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            if tags is not None and not any(t in line for t in tags):
                continue
            p = line.split()
            if len(p) < 10:
                continue
            la, lp = p[1].split(":")
            ra, rp = p[2].split(":")
            try:
                out.append((_hex_addr(la), int(lp, 16), _hex_addr(ra), int(rp, 16), _STATES.get(p[3], p[3]),
                            int(p[7]), p[9]))
            except ValueError:
                continue
    return out


def user_name(uid: int) -> str:
    """``uid N (name)``, or ``uid N`` when the name is unknown."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def peer_uid(ours: tuple, theirs: tuple, table=None) -> Optional[int]:
    """The uid owning the socket at ``theirs`` (ip, port) connected to ``ours`` (ip, port), when
    that socket is on this machine; None otherwise."""
    ours = (_norm(ours[0]), ours[1])
    theirs = (_norm(theirs[0]), theirs[1])
    for la, lp, ra, rp, _st, uid, _ino in (table if table is not None else tcp_table()):
        if (la, lp) == theirs and (ra, rp) == ours:
            return uid
    return None


def describe_peer(sock: socket.socket) -> str:
    """``127.0.0.1:53422 (uid 65534 (nobody))`` for the other end of a TCP socket."""
    try:
        ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:
        return "a peer that went away"
    uid = peer_uid(ours, theirs)
    return f"{_norm(theirs[0])}:{theirs[1]}" + (f" ({user_name(uid)})" if uid is not None else "")


def listening_ports(pid: Optional[int] = None) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket process ``pid`` (default: this one) listens on."""
    base = f"/proc/{pid or os.getpid()}/fd"
    inodes = set()
    for fd in os.listdir(base):
        try:
            link = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return {(la, lp) for la, lp, _ra, _rp, st, _uid, ino in tcp_table() if st == "LISTEN" and ino in inodes}


def foreign_connections(ports: Iterable[int], allowed_uids: Iterable[int], ip: Optional[str] = None) -> list[str]:
    """Connections made from this machine to one of ``ports`` (of ``ip``) by a uid not in
    ``allowed_uids``: ``["uid 65534 (nobody) from 127.0.0.1:40112 to port 36755", ...]``."""
    ports, allowed = set(ports), set(allowed_uids)
    out = []
    for la, lp, ra, rp, st, uid, _ino in tcp_table():
        if st == "ESTABLISHED" and rp in ports and (ip is None or ra == _norm(ip)) and uid not in allowed:
            out.append(f"{user_name(uid)} from {la}:{lp} to port {rp}")
    return out


def port_holder(ip: str, port: int) -> str:
    """Who listens on ``ip:port`` (or on every address of that port), from ``/proc/net/tcp{,6}``
    and, where this process may read them, the other processes' descriptors: ``uid 65534 (nobody),
    pid 4242 (python3)``; ``""`` when nothing listening there is listed."""
    want = _norm(ip)
    found = [(uid, ino) for la, lp, _ra, _rp, st, uid, ino in tcp_table()
             if st == "LISTEN" and lp == port and la in (want, "0.0.0.0", "::")]
    if not found:
        return ""
    uid, ino = found[0]
    pids = []
    target = f"socket:[{ino}]"
    try:
        procs = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        procs = []
    for d in procs:
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except OSError:
            continue  # another user's process: not ours to read
        for fd in fds:
            try:
                if os.readlink(f"/proc/{d}/fd/{fd}") == target:
                    pids.append(d)
                    break
            except OSError:
                continue
        if len(pids) >= 3:
            break
    names = []
    for d in pids:
        try:
            with open(f"/proc/{d}/comm") as f:
                names.append(f"pid {d} ({f.read().strip()})")
        except OSError:
            names.append(f"pid {d}")
    return user_name(uid) + (", " + ", ".join(names) if names else " (its process is not readable here)")


__all__ = ["tcp_table", "peer_uid", "describe_peer", "listening_ports", "foreign_connections", "user_name",
           "port_holder"]


def descriptor_error(e: OSError, what: str, who: str = "this process") -> Optional[DescriptorLimitError]:
    """A :class:`DescriptorLimitError` for ``e`` when it is EMFILE/ENFILE (else None)."""
    if e.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    try:
        n = len(os.listdir("/proc/self/fd"))
    except OSError:
        n = -1
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    scope = "the system's file table is full (fs.file-max)" if e.errno == errno.ENFILE else \
        f"it holds {n} descriptors, its limit (RLIMIT_NOFILE) is {soft} (hard {hard})"
    return DescriptorLimitError(
        f"{who} (pid {os.getpid()}) ran out of file descriptors {what}: {scope}; raise the limit "
        f"(ulimit -n {min(hard, max(soft * 4, 65536)) if hard > 0 else 65536}, or resource.setrlimit in the "
        f"process) or find what holds them (ls -l /proc/{os.getpid()}/fd)")
