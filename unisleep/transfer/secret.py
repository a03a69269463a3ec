"""The group secret: 256 random bits that every member of a transfer group holds, and nobody else.

Where a member finds it (first match wins):

1. ``secret=`` given to :meth:`TransferGroup.create` (32+ bytes, or their hex);
2. ``secret_file=`` — a file of mode 0600 (or stricter) holding the hex, owned by this user or root;
3. the environment: ``UNISLEEP_TRANSFER_SECRET`` (the hex) or ``UNISLEEP_TRANSFER_SECRET_FILE``
   (a path, as in 2);
4. a loopback group only: rank 0 makes a fresh secret and writes it to a 0600 file in this user's
   private run directory (mode 0700, :func:`private_dir`), named after the rendezvous port and
   group name; the other ranks — same machine, same user — read it there.  Different users must
   share a secret explicitly (2 or 3).

A non-loopback group without a secret is refused unless ``insecure=True`` (a warning; records are
then only checked for integrity, not for who wrote them).  The secret is never logged, never in a
``repr`` and never on a command line: pass it through a file or the environment.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
import time
from typing import Optional, Union

from ..errors import InvalidArgumentError, TransferError
from ..private_dir import private_dir

ENV_SECRET = "UNISLEEP_TRANSFER_SECRET"
ENV_SECRET_FILE = "UNISLEEP_TRANSFER_SECRET_FILE"
SECRET_BYTES = 32
#: the public key of an ``insecure=True`` group (integrity only)
INSECURE_SECRET = b"unisleep insecure transfer group, no secret given...."[:SECRET_BYTES]


def new_secret() -> bytes:
    """256 fresh random bits from the operating system."""
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(value: Union[bytes, str], where: str) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        if len(raw) >= 2 * SECRET_BYTES and all(c in b"0123456789abcdefABCDEF" for c in raw.strip()):
            raw = bytes.fromhex(raw.strip().decode())
    elif isinstance(value, str):
        try:
            raw = bytes.fromhex(value.strip())
        except ValueError:
            raise InvalidArgumentError(f"the transfer secret from {where} is not hex; write it as "
                                       f"{2 * SECRET_BYTES} hex digits (e.g. python -c 'import secrets; "
                                       "print(secrets.token_hex(32))')") from None
    else:
        raise InvalidArgumentError(f"the transfer secret from {where} must be bytes or a hex string, "
                                   f"not {type(value).__name__}")
    if len(raw) < SECRET_BYTES:
        raise InvalidArgumentError(f"the transfer secret from {where} has {8 * len(raw)} bits; it needs at least "
                                   f"{8 * SECRET_BYTES} (python -c 'import secrets; print(secrets.token_hex(32))')")
    return raw


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``, which must be a regular file of mode 0600 or stricter, owned by
    this user or root."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidArgumentError(f"cannot read the transfer secret file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"the transfer secret file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise InvalidArgumentError(f"the transfer secret file {path} has mode {oct(st.st_mode & 0o777)}; other "
                                       f"users may read it: chmod 600 {path}")
        if st.st_uid not in (os.getuid(), 0):
            raise InvalidArgumentError(f"the transfer secret file {path} belongs to uid {st.st_uid}, not to this "
                                       f"user (uid {os.getuid()}) or root")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return parse_secret(data.strip(), path)


def write_secret_file(path: str, secret: Optional[bytes] = None) -> bytes:
    """Write ``secret`` (default: a new one) as hex to ``path`` with mode 0600, replacing any file
    there atomically; returns the secret.  Hand the path (never the secret) to the other members."""
    secret = new_secret() if secret is None else parse_secret(secret, "write_secret_file")
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=d)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret.hex().encode() + b"\n")
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return secret


def loopback_secret_path(port: int, name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:64]
    return os.path.join(private_dir(), f"transfer-{port}-{safe}.secret")


def resolve_secret(*, secret, secret_file, rank: int, loopback: bool, insecure: bool, port: int, name: str,
                   timeout_s: float) -> tuple[bytes, str]:
    """(secret, where it came from: 'argument', 'file', 'environment', 'loopback file', 'insecure')."""
    if secret is not None:
        return parse_secret(secret, "the secret= argument"), "argument"
    if secret_file:
        return read_secret_file(secret_file), "file"
    env = os.environ.get(ENV_SECRET)
    if env:
        return parse_secret(env, ENV_SECRET), "environment"
    env_file = os.environ.get(ENV_SECRET_FILE)
    if env_file:
        return read_secret_file(env_file), "environment file"
    if loopback:
        path = loopback_secret_path(port, name)
        if rank == 0:
            return write_secret_file(path), "loopback file"
        return wait_secret_file(path, timeout_s, f"transfer group {name!r} on port {port}: rank {rank}"), "loopback file"
    if insecure:
        return INSECURE_SECRET, "insecure"
    raise InvalidArgumentError(
        "a transfer group on a non-loopback address needs a shared secret: give every member the same "
        f"256-bit secret through {ENV_SECRET_FILE}=<file of mode 0600> (or {ENV_SECRET}, or "
        "TransferGroup.create(..., secret_file=...)); make one with `python -c 'import secrets; "
        "print(secrets.token_hex(32))' > secret && chmod 600 secret`. insecure=True runs without one (anyone who "
        "can reach the address can then feed this group weights)")


def wait_secret_file(path: str, timeout_s: float, who: str = "this rank") -> bytes:
    from .waiting import WaitNotice

    deadline = time.monotonic() + timeout_s
    notice = WaitNotice(f"{who} is waiting for rank 0 (the sender) to start the group: its secret file {path} is not "
                        "there yet", timeout_s)
    while True:
        notice.tick()
        if os.path.exists(path):
            try:
                return read_secret_file(path)
            except InvalidArgumentError:
                if time.monotonic() > deadline:
                    raise
        elif time.monotonic() > deadline:
            raise TransferError(f"rank 0 did not write the group secret to {path} within {timeout_s:.0f} s; a loopback "
                                "group's ranks must run as the same user (or give every rank the secret through "
                                f"{ENV_SECRET_FILE})")
        time.sleep(0.05)


__all__ = ["ENV_SECRET", "ENV_SECRET_FILE", "new_secret", "read_secret_file", "write_secret_file", "private_dir",
           "resolve_secret"]
