"""Extra cleanup: free what lives *outside* the sleeping pools, and bring it back on wake.

The same policy as vllm-ascend's opt-in ``rl_config.sleep_mode_extra_cleanup``, for every
platform:

* **sleep** — release the registered graph workspaces (captured graphs and their pools), wait
  for the device, then tear down the registered collective groups (their communicators hold
  device memory);
* **wake** — restore the groups, in registration order (creating a group is collective: every
  rank must do it in the same order), then recapture the graphs **only when the wake covers
  the KV cache** (``tags`` is None or contains ``"kv_cache"``), never after a weights-only wake:
  a graph captured before the weights are reloaded and the KV cache is mapped would be captured
  against memory that is not ready.

It trades a smaller sleep footprint for a slower wake, so it is off unless asked for::

    cleanup = install_extra_cleanup(lifecycle, {"sleep_mode_extra_cleanup": True})
    tp = cleanup.add_group("tp", ranks=[0, 1])            # collective: every rank, same order
    cleanup.add_graphs("decode", capture=runner.capture_model, release=runner.reset_graphs)
    ...
    cleanup.group("tp")   # the live group (a new object after each wake)

This module is vendor-neutral: the group backend defaults to the platform's collective backend
(:mod:`unisleep.platform`), synchronisation is the lifecycle driver's, and graph capture and
release are the caller's callables.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .errors import InvalidArgumentError, InvalidTransitionError

log = logging.getLogger("unisleep.extra_cleanup")

KV_CACHE_TAG = "kv_cache"
CONFIG_KEY = "sleep_mode_extra_cleanup"


@dataclass
class _Group:
    name: str
    ranks: Optional[list[int]]
    backend: Optional[str]
    factory: Optional[Callable[[], Any]]
    destroy: Optional[Callable[[Any], None]]
    on_restore: Optional[Callable[[Any], None]]
    kwargs: dict = field(default_factory=dict)
    handle: Any = None


@dataclass
class _Graphs:
    name: str
    capture: Callable[[], Any]
    release: Optional[Callable[[], None]]
    captured: bool = True


class ExtraCleanup:
    """Collective groups and graph captures that are torn down on sleep and rebuilt on wake.

    ``synchronize`` waits for the device before groups are torn down (default: the lifecycle
    driver's, once :meth:`install` ed; else ``torch.accelerator.synchronize`` when present).
    """

    def __init__(self, synchronize: Optional[Callable[[], None]] = None):
        self._sync = synchronize
        self._groups: dict[str, _Group] = {}
        self._graphs: dict[str, _Graphs] = {}
        self.torn_down = False
        self.events: list[tuple[str, str]] = []  # (action, name), for logs and tests

    # ------------------------------------------------------------------ registration
    def add_group(
        self,
        name: str,
        *,
        ranks: Optional[Iterable[int]] = None,
        backend: Optional[str] = None,
        factory: Optional[Callable[[], Any]] = None,
        destroy: Optional[Callable[[Any], None]] = None,
        on_restore: Optional[Callable[[Any], None]] = None,
        group: Any = None,
        **new_group_kwargs: Any,
    ):
        """Register a collective group and return it (created now unless ``group`` is given).

        By default the group is ``torch.distributed.new_group(ranks, backend=...)`` (backend:
        the platform's collective backend) and is torn down with ``destroy_process_group``.
        ``factory``/``destroy`` replace those for groups that are not torch.distributed groups
        (e.g. a stateless communicator).  ``on_restore(new_group)`` lets a framework rebind
        its reference after a wake.  Creating groups is collective: call this on every rank,
        in the same order.
        """
        if name in self._groups:
            raise InvalidArgumentError(f"a group named {name!r} is already registered")
        g = _Group(name, None if ranks is None else list(ranks), backend, factory, destroy, on_restore, new_group_kwargs)
        g.handle = group if group is not None else self._create(g)
        self._groups[name] = g
        return g.handle

    def add_graphs(self, name: str, capture: Callable[[], Any], release: Optional[Callable[[], None]] = None) -> None:
        """Register captured graphs: ``release()`` frees them (and their workspaces) on sleep,
        ``capture()`` captures them again on a wake that covers the KV cache.  They are taken
        as captured already (call ``capture`` yourself first, as the engine does at start)."""
        if name in self._graphs:
            raise InvalidArgumentError(f"graphs named {name!r} are already registered")
        self._graphs[name] = _Graphs(name, capture, release)

    def group(self, name: str):
        """The live group ``name``; raises while it is torn down (asleep)."""
        g = self._groups.get(name)
        if g is None:
            raise InvalidArgumentError(f"no group named {name!r}; registered: {', '.join(self._groups) or 'none'}")
        if g.handle is None:
            raise InvalidTransitionError(f"group {name!r} is torn down while asleep; wake up first")
        return g.handle

    # ------------------------------------------------------------------ policy
    def before_sleep(self, level: int = 1, tags: Optional[Iterable[str]] = None) -> None:
        """Release graph workspaces, wait for the device, tear down the groups.  Idempotent."""
        for gr in self._graphs.values():
            if gr.captured:
                if gr.release is not None:
                    gr.release()
                gr.captured = False
                self.events.append(("release_graphs", gr.name))
        live = [g for g in self._groups.values() if g.handle is not None]
        if live:
            self._synchronize()
        for g in reversed(live):
            self._destroy(g)
            self.events.append(("destroy_group", g.name))
        self.torn_down = True

    def after_wake(self, tags: Optional[Iterable[str]] = None) -> None:
        """Restore the groups (registration order), then recapture graphs if the wake covers
        the KV cache (``tags`` None or containing ``"kv_cache"``)."""
        self.restore_groups()
        tag_list = None if tags is None else list(tags)
        if tag_list is not None and KV_CACHE_TAG not in tag_list:
            return  # a weights-only wake: graphs wait for the KV cache
        for gr in self._graphs.values():
            if not gr.captured:
                gr.capture()
                gr.captured = True
                self.events.append(("capture_graphs", gr.name))

    def restore_groups(self) -> None:
        """Re-create every torn-down group, in registration order (collective)."""
        for g in self._groups.values():
            if g.handle is None:
                g.handle = self._create(g)
                self.events.append(("restore_group", g.name))
                if g.on_restore is not None:
                    g.on_restore(g.handle)
        self.torn_down = False

    def install(self, lifecycle) -> "ExtraCleanup":
        """Run this policy on ``lifecycle``'s sleeps and wakes (``MemoryLifecycle.add_hooks``)."""
        if self._sync is None:
            self._sync = lifecycle.driver.synchronize
        lifecycle.add_hooks(before_sleep=self.before_sleep, after_wake=self.after_wake)
        return self

    # ------------------------------------------------------------------ primitives
    def _synchronize(self) -> None:
        if self._sync is not None:
            self._sync()
            return
        import torch

        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            acc.synchronize()

    def _create(self, g: _Group):
        if g.factory is not None:
            return g.factory()
        import torch.distributed as dist

        backend = g.backend
        if backend is None:
            from .platform import detect_platform

            backend = detect_platform().collective_backend
        return dist.new_group(ranks=g.ranks, backend=backend, **g.kwargs)

    def _destroy(self, g: _Group) -> None:
        handle, g.handle = g.handle, None
        if g.destroy is not None:
            g.destroy(handle)
            return
        import torch.distributed as dist

        dist.destroy_process_group(handle)


def extra_cleanup_enabled(config: Optional[Mapping[str, Any]]) -> bool:
    """True when ``config`` (an ``rl_config``-style mapping) turns the extra cleanup on."""
    return bool(config and config.get(CONFIG_KEY, False))


def install_extra_cleanup(
    lifecycle, config: Optional[Mapping[str, Any]] = None, *, enabled: Optional[bool] = None, **kwargs: Any
) -> Optional[ExtraCleanup]:
    """Opt-in: install an :class:`ExtraCleanup` on ``lifecycle`` when ``enabled`` (or
    ``config["sleep_mode_extra_cleanup"]``) is true; otherwise return None and change nothing."""
    on = extra_cleanup_enabled(config) if enabled is None else bool(enabled)
    if not on:
        return None
    return ExtraCleanup(**kwargs).install(lifecycle)


__all__ = ["ExtraCleanup", "install_extra_cleanup", "extra_cleanup_enabled", "KV_CACHE_TAG", "CONFIG_KEY"]
