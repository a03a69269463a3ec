#!/usr/bin/env python3
"""Run torch_memory_saver's own examples (copied by fetch.py into ``upstream/``) against unisleep's
facade, one fresh process per case, as torch_memory_saver's ``test/test_examples.py`` runs them:
the same functions, hook modes and environment variables.  On a machine with an NVIDIA GPU:

    python tools/tms_examples/run.py                 # every case below; exit 1 if one fails
    python tools/tms_examples/run.py --only training_engine --out out/tms-examples.json

Each case's process imports nothing of torch_memory_saver's package but the two test helpers
the examples use (``testing_utils``, ``utils``), served as submodules of the facade; the examples
themselves run unmodified.  Cases for Intel XPU and for two or more GPUs are not listed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
UPSTREAM = os.path.join(HERE, "upstream")

#: (case, example module, function, hook mode, environment) — test/test_examples.py's cases
CASES = [
    ("simple[preload]", "simple", "run", "preload", {}),
    ("simple[torch]", "simple", "run", "torch", {}),
    ("cuda_graph[preload]", "cuda_graph", "run", "preload", {}),
    ("cuda_graph[torch]", "cuda_graph", "run", "torch", {}),
    ("cpu_backup[preload]", "cpu_backup", "run", "preload", {}),
    ("cpu_backup[torch]", "cpu_backup", "run", "torch", {}),
    ("cpu_backup_rss", "cpu_backup", "run_rss", "torch", {}),
    ("cpu_backup_backend_from_env[preload]", "cpu_backup", "run_backend_from_env", "preload",
     {"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}),
    ("cpu_backup_backend_from_env[torch]", "cpu_backup", "run_backend_from_env", "torch",
     {"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}),
    ("cpu_backup_preload_backend_from_env", "cpu_backup", "run_preload_backend_from_env", "preload",
     {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}),
    ("cpu_backup_retain_from_env[preload]", "cpu_backup", "run_retain_from_env", "preload",
     {"TMS_RETAIN_CPU_BACKUP": "1"}),
    ("cpu_backup_retain_from_env[torch]", "cpu_backup", "run_retain_from_env", "torch", {"TMS_RETAIN_CPU_BACKUP": "1"}),
    ("disk_backup[preload]", "disk_backup", "run", "preload", {}),
    ("disk_backup[torch]", "disk_backup", "run", "torch", {}),
    ("rl_example[preload]", "rl_example", "run", "preload", {}),
    ("rl_example[torch]", "rl_example", "run", "torch", {}),
    ("training_engine", "training_engine", "run", "preload", {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}),
    ("cuda_vmm_granularity", "cuda_vmm_granularity", "run", "preload", {"TMS_INIT_ENABLE": "1"}),
    ("nested_region", "nested_region", "run", "preload", {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}),
]

BOOT = """
    import importlib.util, os, sys
    import unisleep.compat
    unisleep.compat.install()            # `import torch_memory_saver` gives unisleep's facade
    import torch_memory_saver
    up = os.environ["TMS_EXAMPLES_UPSTREAM"]
    for name in ("utils", "testing_utils"):  # torch_memory_saver's test helpers, as submodules
        spec = importlib.util.spec_from_file_location(f"torch_memory_saver.{name}", f"{up}/torch_memory_saver/{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    sys.path.insert(0, os.path.join(up, "test"))
    example = importlib.import_module("examples." + sys.argv[1])
    getattr(example, sys.argv[2])(hook_mode=sys.argv[3])
    print("CASE PASSED", flush=True)
"""


def run_case(case, timeout: int) -> dict:
    name, module, fn, mode, extra = case
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env.update(extra)
    env["TMS_EXAMPLES_UPSTREAM"] = UPSTREAM
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(BOOT), module, fn, mode], capture_output=True,
                           text=True, env=env, timeout=timeout, cwd=ROOT)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {timeout} s\n" + ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
    ok = rc == 0 and "CASE PASSED" in out
    return {"case": name, "passed": ok, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": out[-6000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="cases whose name starts with one of these")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(UPSTREAM, "test", "examples")):
        print(f"no examples in {UPSTREAM}: run tools/tms_examples/fetch.py first", file=sys.stderr)
        return 2
    with open(os.path.join(UPSTREAM, "REF")) as f:
        ref = f.read().strip()
    cases = [c for c in CASES if not args.only or any(c[0].startswith(o) for o in args.only)]
    results = []
    for c in cases:
        r = run_case(c, args.timeout)
        results.append(r)
        print(f"{'PASS' if r['passed'] else 'FAIL'} {r['case']} ({r['seconds']} s)", flush=True)
        if not r["passed"]:
            print(textwrap.indent(r["tail"][-3000:], "    "), flush=True)
    passed = sum(r["passed"] for r in results)
    print(f"torch_memory_saver examples at {ref} against unisleep's facade: {passed} passed, {len(results) - passed} failed")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"ref": ref, "python": sys.version.split()[0], "results": results}, f, indent=1)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
