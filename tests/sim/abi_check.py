"""Not a simulator: the comparisons of the ROCm and Ascend ctypes bindings with references
that are not the bindings — used by the header tests and by the ABI mutation tests, which feed
the same comparisons mutated copies of the declarations.

* HIP >= 5.3 (what ROCm 6.x/7.x users get): AMD's ``hip-python`` releases read by
  ``hip_python_reference.py`` in a child process (``make test`` installs 6.2 and 7.2 under
  ``<venv>/hip-python/<release>``; ``UNISLEEP_HIP_PYTHON_DIR`` points elsewhere);
* ACL: ``acl_rt_table.json`` (what the bindings use from CANN 9.1.0's ``acl_rt.h``) compiled
  into a header the probes run against, and CANN's own headers where installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

from . import abi_probe

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)

#: the hip-python releases CPU CI reads (one per ROCm major with the >= 5.3 layout)
HIP_PYTHON_RELEASES = {"6.2": "6.2.0.499.16", "7.2": "7.2.2.562.43"}
HIP_PYTHON_INSTALL = ("make test installs it (`pip install --no-deps --target <venv>/hip-python/{release} "
                      "hip-python=={version}`)")


def hip_python_dir(release: str) -> str:
    base = os.environ.get("UNISLEEP_HIP_PYTHON_DIR") or os.path.join(sys.prefix, "hip-python")
    return os.path.join(base, release)


def hip_python_reference(release: str) -> Optional[dict]:
    """The reference read from hip-python ``release``, or None when it is not installed."""
    where = hip_python_dir(release)
    if not os.path.isdir(os.path.join(where, "hip")):
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, where]))
    out = subprocess.run([sys.executable, os.path.join(HERE, "hip_python_reference.py")], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"reading hip-python {release} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def hip_problems(ref: dict, structs: dict, enums: dict, signatures: dict) -> list[str]:
    """Differences between the HIP bindings (the declarations for the reference's HIP_VERSION)
    and a hip-python reference: struct layout (sizes and offsets), values, prototypes with
    parameter names.  Alignments are checked against the real 5.2 header only (hip-python does
    not expose them)."""
    ours = {k: v for k, v in abi_probe.binding_layout(structs, {}).items() if not k.startswith("alignof ")}
    ours.update({f"value {n}": v for n, v in enums.items()})
    theirs = dict(ref["layout"])
    theirs.update(ref["values"])
    problems = abi_probe.diff(ours, theirs)
    problems += abi_probe.diff(abi_probe.binding_signatures(signatures), ref["prototypes"])
    return problems


def hip_declarations(version: int, hip=None):
    """The HIP bindings' (structs, enums, signatures) for a runtime of HIP_VERSION ``version``."""
    if hip is None:
        from unisleep.backends.rocm import hip
    return hip.structs(version), dict(hip.ENUMS), hip.signatures(hip.alloc_prop_type(version))


# ---------------------------------------------------------------------------- ACL
TABLE_PATH = os.path.join(HERE, "acl_rt_table.json")


def acl_table() -> dict:
    with open(TABLE_PATH) as f:
        return json.load(f)


def acl_reference_from_table(tmp_path, structs: dict, enums: dict, table: Optional[dict] = None) -> dict:
    """Compile the probes against a header generated from the table: the compiler lays out the
    structs and computes the enumerators; parameter names are the table's."""
    table = table or acl_table()
    d = tmp_path / "acl_table"
    (d / "acl").mkdir(parents=True, exist_ok=True)
    (d / "acl" / "acl_rt.h").write_text(abi_probe.header_from_table(table))
    flags = [f"-I{d}"]
    keys = abi_probe.binding_layout(structs, enums)
    layout = abi_probe.c_layout_probe(tmp_path, "acl/acl_rt.h", flags, keys)
    layout.pop("VERSION")
    protos = abi_probe.cxx_prototype_probe(tmp_path, "acl/acl_rt.h", flags, list(table["functions"]))
    names = {n: [p for p, _ in params] for n, (_, params) in table["functions"].items()}
    return {"layout": layout, "prototypes": abi_probe.with_names(protos, names)}


def acl_reference_from_header(tmp_path, include: str, structs: dict, enums: dict, functions) -> dict:
    """The same reference from CANN's own headers (``include`` holds ``acl/acl_rt.h``)."""
    flags = [f"-I{include}"]
    layout = abi_probe.c_layout_probe(tmp_path, "acl/acl_rt.h", flags, abi_probe.binding_layout(structs, enums))
    layout.pop("VERSION")
    protos = abi_probe.cxx_prototype_probe(tmp_path, "acl/acl_rt.h", flags, list(functions))
    with open(os.path.join(include, "acl", "acl_rt.h")) as f:
        names = abi_probe.header_parameter_names(f.read(), functions)
    return {"layout": layout, "prototypes": abi_probe.with_names(protos, names)}


def acl_problems(ref: dict, structs: dict, enums: dict, signatures: dict) -> list[str]:
    problems = abi_probe.diff(abi_probe.binding_layout(structs, enums), ref["layout"])
    problems += abi_probe.diff(abi_probe.binding_signatures(signatures), ref["prototypes"])
    return problems
