"""What ``unisleep demo --model`` shows of the device memory, beside its checks: the timeline's
marks of a step with what no lifecycle or allocator accounts for (:func:`memory_rows`), their
table (:func:`format_memory`), the peak (:func:`memory_peak`), the figure (:func:`plot_scaled`)
and the unit of a table of byte counts (:func:`table_unit`, :func:`gib`); all importable from
:mod:`.scaled`."""

from __future__ import annotations

from typing import Optional

from . import residue as R
from .report import finish_with_reward, three_panels

GiB = 1 << 30


def gib(n, unit: tuple[str, int] = ("GiB", GiB)) -> str:
    """``n`` bytes in ``unit`` (name, bytes), two decimals; "n/a" for None."""
    return "n/a" if n is None else f"{n / unit[1]:.2f}"


def table_unit(*sizes) -> tuple[str, int]:
    """The unit of a table of byte counts: the largest of GiB, MiB, KiB in which its largest entry
    is at least 1 (a model of a few MiB would read 0.00 in GiB everywhere)."""
    top = max((abs(n) for n in sizes if n is not None), default=0)
    for name, div in (("GiB", GiB), ("MiB", 1 << 20)):
        if top >= div:
            return name, div
    return "KiB", 1 << 10


def plot_scaled(steps, timeline, path: str, title: str, total: Optional[int] = None) -> Optional[str]:
    panels = three_panels((9, 9))
    if panels is None:
        return None
    fig, (ax1, ax2, ax3) = panels
    ts = [e["t"] for e in timeline]
    for key, label in (("engine", "engine (lifecycle: weights + KV cache)"),
                       ("engine_allocator", "engine (framework allocator: activations, received buckets)"),
                       ("trainer", "trainer (lifecycle: weights + AdamW state + grads)"),
                       ("trainer_allocator", "trainer (framework allocator: activations, serving copy)")):
        ax1.step(ts, [e[key] / GiB for e in timeline], where="post", label=label)
    if any(e.get("device_used") for e in timeline):
        ax1.step(ts, [(e.get("device_used") or 0) / GiB for e in timeline], where="post", color="k", lw=0.8,
                 ls="--", label="device memory in use (all processes)")
    if total:
        ax1.axhline(total / GiB, color="r", lw=0.8, ls=":", label=f"device memory ({total / GiB:.1f} GiB)")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("GiB on the device")
    ax1.set_title(title)
    ax1.legend(fontsize=7)
    xs = [s.step for s in steps]
    b1 = [s.sleep_ms for s in steps]
    b2 = [s.wake_weights_ms for s in steps]
    b3 = [s.transfer_ms for s in steps]
    ax2.bar(xs, b1, label="engine sleep")
    ax2.bar(xs, b2, bottom=b1, label="weights wake")
    ax2.bar(xs, b3, bottom=[a + b for a, b in zip(b1, b2)], label="transfer (verified)")
    ax2.set_ylabel("ms")
    ax2.legend(fontsize=7)
    return finish_with_reward(fig, ax3, steps, path)


def memory_rows(timeline: list[dict], step: int) -> list[dict]:
    """The timeline's marks of ``step`` (0: the start), each with what no lifecycle or allocator
    of the two processes accounts for (device contexts, communication buffers, the transfer's
    shared bucket buffers; on the host: interpreters, libraries, heaps): ``other``; the memory in
    use (``in_use``); the transfer's buckets both sides hold (``transfer``); and, where one side
    works and the other sleeps, what the sleeping side leaves (``residue``, :mod:`.residue`)."""
    base = R.baseline(timeline)
    rows = []
    for e in timeline:
        if e["step"] != step:
            continue
        rows.append({**e, "other": R.other(e), "in_use": R.in_use(e),
                     "transfer": e.get("engine_transfer", 0) + e.get("trainer_transfer", 0),
                     "residue": R.residue(e, base)})
    return rows


def _backup_total(hb) -> Optional[int]:
    return None if hb is None else sum(hb.values())


def format_memory(timeline: list[dict], step: int) -> str:
    rows = memory_rows(timeline, step)
    backups = any(e.get("engine_host_backup") is not None or e.get("trainer_host_backup") is not None for e in rows)
    u = table_unit(*(e.get(k) for e in rows for k in ("engine", "engine_allocator", "trainer", "trainer_allocator",
                                                     "transfer", "other", "in_use")))
    head = (f"{'phase (step ' + str(step) + '), ' + u[0]:<44} {'works':>7} {'eng life':>8} {'eng alloc':>9} "
            f"{'trn life':>8} {'trn alloc':>9} {'xfer':>5} {'other':>6} {'in use':>7} {'residue/allowed':>16}"
            + (f" {'eng host':>8} {'trn host':>8}" if backups else ""))
    lines = [head, "-" * len(head)]
    for e in rows:
        r = e["residue"]
        res = ("" if r is None else
               f"{gib(r['bytes'], u)}/{gib(r['allowed'], u)}{' !' if r['bytes'] > r['allowed'] else ''}")
        line = (f"{e['phase'][:44]:<44} {e.get('works') or '':>7} {gib(e['engine'], u):>8} "
                f"{gib(e.get('engine_allocator', 0), u):>9} {gib(e['trainer'], u):>8} "
                f"{gib(e.get('trainer_allocator', 0), u):>9} {gib(e['transfer'], u):>5} {gib(e['other'], u):>6} "
                f"{gib(e['in_use'], u):>7} {res:>16}")
        if backups:
            line += (f" {gib(_backup_total(e.get('engine_host_backup')), u):>8}"
                     f" {gib(_backup_total(e.get('trainer_host_backup')), u):>8}")
        lines.append(line)
    return "\n".join(lines)


def memory_peak(timeline: list[dict], total: Optional[int]) -> Optional[dict]:
    """The mark with the most device memory in use (all processes), or None on host."""
    marks = [e for e in timeline if e.get("device_used") is not None]
    if not marks:
        return None
    e = max(marks, key=lambda m: m["device_used"])
    return {"device_used": e["device_used"], "phase": e["phase"], "step": e["step"], "device_total": total,
            "engine": e["engine"] + e["engine_allocator"], "trainer": e["trainer"] + e["trainer_allocator"]}
