"""``unisleep bench``: dispatch to one benchmark.

=====================  ===================================================================
(no flag)              host sleep/wake throughput beside its limits (``unisleep.bench.host``)
``--backend NAME``     sleep/wake on a backend (an accelerator: the large workload, with peers,
                       then the two host-backup policies and NUMA copies; ``--host-policies``:
                       only those)
``--transfer``         weight transfer by path (``unisleep.bench.transfer``)
``--chunk-sweep``      map/unmap cost by chunk size (``unisleep.bench.chunk_sweep``)
``--compat-tms``       tms facade beside tms 0.0.10 (``unisleep.bench.compat_tms``)
``--progressive``      progressive wake / background sleep beside the plain ones (``unisleep.bench.progressive``)
``--encoding``         the "planes" backup encoding beside plain backups (``unisleep.bench.encoding``)
``--devices SPEC``     every device of a node sleeping and waking at once, one process each
                       (``unisleep.bench.devices``)
=====================  ===================================================================

Every mode prints a table and writes JSON: ``bench-<mode>.json`` in ``--out FOLDER`` (default out/), or the file ``--json PATH`` names.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from typing import Optional, Sequence

from ..errors import InvalidArgumentError, PlatformError, UnisleepError

MODES = (
    ("(no mode flag)", "host sleep/wake throughput beside its limits, measured in the same run"),
    ("--backend NAME", "sleep/wake on a backend's devices (the large workload, beside other libraries; then the "
                       "host-backup policies side by side and NUMA copies, alone with --host-policies)"),
    ("--transfer", "weight transfer by path"),
    ("--chunk-sweep", "map/unmap cost by chunk size"),
    ("--compat-tms", "the torch_memory_saver facade beside torch_memory_saver 0.0.10, same run"),
    ("--progressive", "progressive wake and background sleep beside the plain ones (with --backend NAME)"),
    ("--encoding", "the lossless 'planes' backup encoding beside plain backups: ratio, sleep, wake, bytes held "
                   "(with --backend host)"),
    ("--devices all|N|LIST", "every device sleeping and waking at the same instant, one process per device, beside "
                             "each device's copy alone and the host's memory bandwidth"),
)


def mode_help() -> str:
    width = max(len(m) for m, _ in MODES)
    lines = ["usage: unisleep bench [--backend NAME [--progressive | --devices SPEC] | --transfer | --chunk-sweep | "
             "--compat-tms] [options]", "",
             "Benchmarks; every mode prints a table and writes JSON. Modes:"]
    lines += [f"  {m:<{width}}  {d}" for m, d in MODES]
    lines += ["", "Each mode's options: unisleep bench --transfer --help, unisleep bench --chunk-sweep --help,",
              "unisleep bench --backend NAME --help, unisleep bench --devices all --help. Without a mode flag (the host "
              "benchmark):", ""]
    return "\n".join(lines)


def _value(argv: Sequence[str], option: str) -> Optional[str]:
    """The last value given to ``option`` (``--opt V`` or ``--opt=V``), or None."""
    found = None
    for i, a in enumerate(argv):
        if a == option and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(option + "="):
            found = a.split("=", 1)[1]
    return found


def platform_with_devices(name: Optional[str], option: str, need_devices: bool = True):
    """The platform ``name`` names (None: the detected one), refused with the reason when there
    is no such backend, or when it is an accelerator of which this machine has no device."""
    from ..platform import detect_platform
    from ..registry import backends

    names = [b.name for b in backends()]
    if name is not None and name not in names:
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        raise InvalidArgumentError(f"{option} {name}: no such backend{f' (did you mean {close[0]}?)' if close else ''}; "
                                   f"the backends are {', '.join(names)}")
    try:
        plat = detect_platform(name)
    except PlatformError as e:
        raise InvalidArgumentError(f"{option} {name}: {e}") from None
    if need_devices and plat.is_accelerator and not plat.devices:
        raise InvalidArgumentError(
            f"{option} {plat.name}: no {plat.name} device was found on this machine, so there is nothing to measure "
            "(unisleep doctor shows what is found). The host benchmark runs anywhere: unisleep bench")
    return plat


def refuse_early(mod: str, argv: Sequence[str]) -> None:
    """What a mode cannot do on this machine, refused before it starts (each mode checks its own
    values): a backend that does not exist or has no device here, --compat-tms without an
    accelerator."""
    if mod in ("unisleep.bench.device", "unisleep.bench.progressive"):
        backend = _value(argv, "--backend")
        if backend is not None:
            platform_with_devices(backend, "--backend")
    elif mod == "unisleep.bench.compat_tms":
        plat = platform_with_devices(None, "--compat-tms: platform")
        if not plat.is_accelerator:
            raise InvalidArgumentError(
                "--compat-tms needs an accelerator: the torch_memory_saver facade's regions route torch's own "
                f"allocations only there, and this machine has none (platform {plat.name}: {plat.reason}). "
                "unisleep doctor shows what is found.")
    elif mod in ("unisleep.bench.chunk_sweep", "unisleep.bench.transfer"):
        name = _value(argv, "--platform")
        if name is not None:  # the transfer's host paths run without the platform's devices
            platform_with_devices(name, "--platform", need_devices=mod == "unisleep.bench.chunk_sweep")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--transfer" in argv:
        argv.remove("--transfer")
        mod = "unisleep.bench.transfer"
    elif "--chunk-sweep" in argv:
        argv.remove("--chunk-sweep")
        mod = "unisleep.bench.chunk_sweep"
    elif "--compat-tms" in argv:
        argv.remove("--compat-tms")
        mod = "unisleep.bench.compat_tms"
    elif "--progressive" in argv:
        mod = "unisleep.bench.progressive"
    elif "--encoding" in argv:
        mod = "unisleep.bench.encoding"  # checks its own backend (host only, for now)
    elif any(a == "--devices" or a.startswith("--devices=") for a in argv):
        mod = "unisleep.bench.devices"  # checks its own values (the platform, the devices) before it starts
    else:
        backend = None
        for i, a in enumerate(argv):
            if a == "--backend" and i + 1 < len(argv):
                backend = argv[i + 1]
            elif a.startswith("--backend="):
                backend = a.split("=", 1)[1]
        host_bench = backend in (None, "host") and not {"--host-policies", "--worker"} & set(argv)
        mod = "unisleep.bench.host" if host_bench else "unisleep.bench.device"
        if mod == "unisleep.bench.host" and ("-h" in argv or "--help" in argv):
            print(mode_help())  # then the host benchmark's own options (argparse exits 0)
    helping = "-h" in argv or "--help" in argv
    worker = any(a == "--worker" or a.startswith("--worker=") for a in argv)  # a child of a run already checked
    if not helping and not worker:
        try:
            refuse_early(mod, argv)
        except UnisleepError as e:
            print(f"unisleep bench: {e}", file=sys.stderr)
            return 2
    return int(importlib.import_module(mod).main(argv) or 0)
