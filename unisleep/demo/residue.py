"""What the sleeping side leaves behind, mark by mark: the accounting behind ``unisleep demo
--model``'s memory table and its *what sleeps is gone* check.

The goal (docs/scale.md): while one side works and the other sleeps, the memory in use minus the
working side's own is at most what the two processes held at the start, before any step — their
device contexts, on the host their interpreters and libraries — plus :data:`ALLOWANCE` for what a
process keeps once it has run (kernels loaded, library handles).  Everything else a side holds —
its lifecycle's sleeping memory, its allocator's cache, the transfer's buckets — must be gone.

What "memory in use" and "own" are:

* **on an accelerator**: the device's memory in use (all processes, ``mem_get_info``); a side's
  own is its lifecycle's resident bytes plus its framework allocator's reserved bytes.  So the
  residue is the sleeping side's lifecycle and allocator bytes plus everything neither lifecycle
  nor allocator holds (``other``: contexts, the transfer's shared buckets, driver state); the
  allowance is ``other`` at the start plus :data:`ALLOWANCE`.
* **on the host**: each process's resident set (``VmRSS``: its lifecycle's memory, interpreter,
  libraries, heaps, transfer buffers); a side's own is its whole process.  So the residue is the
  sleeping process's resident set; the allowance is that process's resident set at the start
  minus its lifecycle's memory then, plus :data:`ALLOWANCE`.
"""

from __future__ import annotations

from typing import Optional

GiB = 1 << 30
#: what a process may keep beyond its start figures while it sleeps (loaded kernels, library
#: handles, small caches): the goal's margin
ALLOWANCE = 256 << 20
#: the mark whose figures are "the start": both processes made, the engine awake, the trainer
#: offloaded, no step and no update yet
BASELINE = "start: engine awake, trainer offloaded"
#: which side works (the other sleeps) at each mark; marks not named here are handoffs
WORKS = {
    BASELINE: "engine",
    "engine generated": "engine",
    "trainer dropped its serving copy": "engine",
    "engine asleep (its allocator cache emptied)": "trainer",
    "trainer: weights + grads awake": "trainer",
    "trainer: backward done": "trainer",
    "trainer: optimizer awake (the step)": "trainer",
    "trainer: stepped, serving copy made": "trainer",
}
SIDES = ("engine", "trainer")


def rss_bytes(pid: Optional[int] = None) -> Optional[int]:
    """The resident set of process ``pid`` (this one by default; another process of this user
    too) in bytes, from ``/proc/<pid>/status``; None where it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def host_backup(lc) -> Optional[dict]:
    """The host memory holding ``lc``'s backups by where it lies (``{"pinned", "pageable",
    "disk"}`` bytes), when its backup store can say (``BackupStore.residency()``); else None."""
    fn = getattr(getattr(lc, "backup_store", None), "residency", None)
    if not callable(fn):
        return None
    try:
        return {k: int(v) for k, v in dict(fn()).items()}
    except Exception:  # a figure for a table: never fail the run for it
        return None


def other(e: dict) -> Optional[int]:
    """What no lifecycle and no allocator of the two sides holds: on a device, its memory in use
    minus those four; on the host, the two resident sets minus the two lifecycles (interpreters,
    libraries, heaps, transfer buffers).  None when neither is known."""
    known = e["engine"] + e.get("engine_allocator", 0) + e["trainer"] + e.get("trainer_allocator", 0)
    used = in_use(e)
    return None if used is None else used - known


def in_use(e: dict) -> Optional[int]:
    """The device memory in use at mark ``e`` (all processes), or on the host the two resident sets."""
    if e.get("device_used") is not None:
        return e["device_used"]
    rss = [e.get(f"{s}_rss") for s in SIDES]
    return None if None in rss else sum(rss)


def baseline(timeline: list[dict]) -> Optional[dict]:
    """The start's figures (:data:`BASELINE`): ``other`` and each side's resident set less its
    lifecycle (host), or None when the run has no such mark."""
    e = next((m for m in timeline if m["phase"] == BASELINE and m["step"] == 0), None)
    if e is None or in_use(e) is None:
        return None
    out = {"other": other(e), "device": e.get("device_used") is not None}
    for s in SIDES:
        rss = e.get(f"{s}_rss")
        out[f"{s}_base"] = None if rss is None else rss - e[s]
    return out


def residue(e: dict, base: Optional[dict]) -> Optional[dict]:
    """At a mark where one side works and the other sleeps: ``{"works", "sleeps", "bytes",
    "allowed", "parts"}`` — the memory in use minus the working side's own, what the goal allows,
    and what it is made of; None at a handoff, at the start, or where nothing is measured."""
    w = e.get("works")
    if w not in SIDES or base is None or e["step"] == 0:
        return None
    s = "trainer" if w == "engine" else "engine"
    parts = {f"{s} lifecycle": e[s], f"{s} allocator": e.get(f"{s}_allocator", 0)}
    if e.get(f"{s}_allocated") is not None and e.get(f"{s}_allocator"):
        parts[f"{s} allocator's live tensors"] = e[f"{s}_allocated"]
    if e.get(f"{s}_live_blocks"):
        parts[f"{s}'s largest live blocks (MiB)"] = e[f"{s}_live_blocks"]
    parts["transfer buffers"] = e.get("engine_transfer", 0) + e.get("trainer_transfer", 0)
    if base["device"]:
        if e.get("device_used") is None:
            return None
        held = e["device_used"] - e[w] - e.get(f"{w}_allocator", 0)
        allowed = base["other"] + ALLOWANCE
        parts["other than at the start"] = other(e) - base["other"]
    else:
        rss = e.get(f"{s}_rss")
        if rss is None or base.get(f"{s}_base") is None:
            return None
        held = rss
        allowed = base[f"{s}_base"] + ALLOWANCE
        parts[f"{s} process beyond the start"] = rss - e[s] - base[f"{s}_base"]
    return {"works": w, "sleeps": s, "bytes": held, "allowed": allowed, "parts": parts}


def residues(timeline: list[dict]) -> list[tuple[dict, dict]]:
    """``(mark, residue)`` for every mark of a step where one side works and the other sleeps."""
    base = baseline(timeline)
    out = []
    for e in timeline:
        r = residue(e, base)
        if r is not None:
            out.append((e, r))
    return out


def summary(timeline: list[dict]) -> Optional[dict]:
    """For ``demo.json``: the start's figures, the allowance, and every checked mark's residue."""
    base = baseline(timeline)
    if base is None:
        return None
    return {"baseline": base, "allowance": ALLOWANCE, "memory": "device" if base["device"] else "host resident sets",
            "marks": [{"step": e["step"], "phase": e["phase"], **r} for e, r in residues(timeline)]}


def gib(n) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def check(timeline: list[dict]):
    """The *what sleeps is gone* check (a :class:`~unisleep.demo.checks.Check`)."""
    from .checks import Check

    name = "what sleeps is gone"
    base = baseline(timeline)
    rs = residues(timeline)
    if base is None or not rs:
        return Check(name, None, "not observable: no memory figures at the start and in the steps of this run")
    where = ("device memory in use (all processes)" if base["device"]
             else "host memory in use (the two processes' resident sets)")
    start = (f"the contexts and what else no lifecycle or allocator held at the start ({gib(base['other'])} GiB)"
             if base["device"] else "the sleeping process's resident set at the start, less its lifecycle")
    over = [(e, r) for e, r in rs if r["bytes"] > r["allowed"]]
    worst = max(rs, key=lambda er: er[1]["bytes"] - er[1]["allowed"])
    if not over:
        e, r = worst
        return Check(name, True,
                     f"at every one of {len(rs)} marks where one side worked and the other slept, {where} minus the "
                     f"working side's own was within {start} + {ALLOWANCE >> 20} MiB (closest: "
                     f"{gib(r['bytes'])} of {gib(r['allowed'])} GiB allowed at '{e['phase']}', step {e['step']})")
    lines = []
    for e, r in over[:4]:
        parts = ", ".join(f"{k} {[round(b / 2**20) for b in v]}" if isinstance(v, list) else f"{k} {gib(v)}"
                          for k, v in r["parts"].items())
        lines.append(f"step {e['step']} '{e['phase']}' ({r['works']} works): {gib(r['bytes'])} GiB > "
                     f"{gib(r['allowed'])} allowed ({parts})")
    return Check(name, False,
                 f"{len(over)} of {len(rs)} marks where one side worked and the other slept left more than {start} + "
                 f"{ALLOWANCE >> 20} MiB in use ({where}): " + "; ".join(lines))


__all__ = ["ALLOWANCE", "BASELINE", "WORKS", "rss_bytes", "host_backup", "other", "in_use", "baseline", "residue",
           "residues", "check", "summary"]
