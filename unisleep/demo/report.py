"""What the demo shows: the progress line, the table per step, the checks' lines, ``demo.json``,
``demo.png`` (embedded engine) and the final verdict."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from .constants import VLLM_PROBE_PROMPTS, MiB
from .steps import DemoStep, VLLMDemoStep, reward_quarters


def progress(args, text: str, final: bool = False) -> None:
    if args.quiet:
        return
    if sys.stdout.isatty():
        sys.stdout.write("\r" + text.ljust(100) + ("\n" if final else ""))
    else:
        sys.stdout.write(text + "\n")
    sys.stdout.flush()


def step_progress(args, step: int, text: str, findings) -> None:
    """The progress line of a finished step (``step`` counts from 1, as in the table; the last one
    ends the line), then one line per gap finding."""
    progress(args, f"step {step}/{args.steps}  {text}", final=step == args.steps)
    for f in findings:
        progress(args, f"  ! {f}", final=True)


def kib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 1024:,.0f}"


def mib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / MiB:,.0f}"


def asleep_label(s: VLLMDemoStep) -> str:
    g = s.sleep_gauge or {}
    if not s.is_sleeping:
        return "no"
    if not g:
        return "yes"
    if g.get("awake", 1) != 0:
        return "paused"  # /is_sleeping is also true while merely paused
    return "L2" if g.get("discard_all") else ("L1" if g.get("weights_offloaded") else "yes")


def format_table(steps: list[DemoStep]) -> str:
    head = (f"{'step':>4} {'version':>7} {'lvl':>3} {'resident KiB':>12} {'released KiB':>12} {'handoff ms':>10} "
            f"{'transfer ms':>11} {'train ms':>8} {'gap |Δlp|':>10} {'probe Δ':>9} {'reward':>6}")
    lines = [head, "-" * len(head)]
    for s in steps:
        lines.append(
            f"{s.step:>4} {s.version:>7} {s.level:>3} {kib(s.resident_before):>12} {kib(s.released):>12} "
            f"{s.handoff_ms:>10.2f} {s.transfer_ms:>11.2f} {s.train_ms:>8.1f} {s.gap:>10.2e} {s.probe_gap:>9.1e} "
            f"{s.reward:>6.2f}"
        )
    return "\n".join(lines)


def format_table_vllm(steps: list[VLLMDemoStep], memory_note: str) -> str:
    head = (f"{'step':>4} {'version':>7} {'asleep':>6} {'freed KiB':>10} {'RSS MiB awake→asleep':>20} "
            f"{'handoff ms':>10} {'transfer ms':>11} {'train ms':>8} {'gap |Δlp|':>10} {'probe Δ':>8} "
            f"{'stale Δ':>8} {'greedy≠v0':>9} {'reward':>6}")
    lines = [head, "-" * len(head)]
    n_probe = len(VLLM_PROBE_PROMPTS)
    for s in steps:
        freed = ("n/a" if s.resident_before is None or s.resident_asleep is None
                 else f"{(s.resident_before - s.resident_asleep) / 1024:,.0f}")
        rss = f"{mib(s.rss_awake)}→{mib(s.rss_asleep)}"
        lines.append(
            f"{s.step:>4} {s.version:>7} {asleep_label(s):>6} {freed:>10} {rss:>20} {s.handoff_ms:>10.1f} "
            f"{s.transfer_ms:>11.1f} {s.train_ms:>8.1f} {s.gap:>10.2e} {s.probe_gap:>8.1e} {s.stale_gap:>8.1e} "
            f"{f'{s.greedy_changed}/{n_probe}':>9} {s.reward:>6.2f}"
        )
    lines.append(f"freed KiB: {memory_note}")
    return "\n".join(lines)


def three_panels(figsize, sharex: bool = False):
    """A figure of three stacked panels (matplotlib, headless), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # no usable matplotlib: no plot, the table still prints
        return None
    return plt.subplots(3, 1, figsize=figsize, sharex=sharex)


def finish_with_reward(fig, ax, steps, path: str) -> str:
    """The last panel: reward per step; then save the figure to ``path``."""
    import matplotlib.pyplot as plt

    ax.plot([s.step for s in steps], [s.reward for s in steps], "o-", color="tab:green")
    ax.set_ylabel("reward")
    ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_steps(steps: list[DemoStep], path: str) -> Optional[str]:
    panels = three_panels((7, 8), sharex=True)
    if panels is None:
        return None
    fig, (ax1, ax2, ax3) = panels
    xs = [s.step for s in steps]
    ax1.plot(xs, [(s.resident_before or 0) / 1024 for s in steps], "o-", label="engine resident, awake")
    ax1.plot(xs, [(s.resident_asleep or 0) / 1024 for s in steps], "s-", label="engine resident, asleep (trainer runs)")
    ax1.set_ylabel("KiB")
    ax1.set_title("engine memory handed to the trainer each step")
    ax1.legend(fontsize=8)
    ax2.plot(xs, [max(s.gap, 1e-9) for s in steps], "o-", label="rollout gap: median |engine − trainer| logprob (0 drawn at 1e-9)")
    ax2.plot(xs, [max(s.probe_gap, 1e-9) for s in steps], "x--", label="probe gap after reacquire (max)")
    ax2.set_yscale("log")
    ax2.set_ylabel("|Δ logprob|")
    ax2.legend(fontsize=8)
    return finish_with_reward(fig, ax3, steps, path)


def print_run(steps, checks, target: int, elapsed: float, how: str = "") -> None:
    """The end of a run of the tiny loop: the table, the reward line, the checks."""
    print()
    if steps:
        print(format_table(steps))
        print()
        r0, r1 = reward_quarters(steps)
        print(f"reward (fraction of token {target}): {r0:.2f} in the first quarter -> {r1:.2f} in the last; "
              f"{len(steps)} steps in {elapsed:.1f} s" + (f" ({how})" if how else ""))
    print_checks(checks)


def print_checks(checks) -> None:
    for c in checks:
        print(f"[{c.label}] {c.name}: {c.detail}")


def write_json(out_dir: str, result: dict) -> str:
    """``demo.json`` in ``out_dir``; returns its path."""
    jpath = os.path.join(out_dir, "demo.json")
    with open(jpath, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return jpath


def verdict(ok: bool) -> int:
    """Print the last line and return the exit code: 0 when every check passed, else 1."""
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1
