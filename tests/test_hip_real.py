"""The ROCm bindings (backends/rocm/hip.py) against the REAL HIP runtime and header — no GPU needed.

Debian 12 packages ROCm 5.2.3's runtime for CPU machines: ``libamdhip64-5`` (``libamdhip64.so.5``)
and ``libamdhip64-dev`` (``hip/hip_runtime_api.h``); ``make test`` installs them when run as root.
These tests:

* load the real library through the driver's own loader and resolve every function the
  bindings declare (a missing symbol fails);
* compile a C probe with ``cc`` against the real header that prints ``sizeof``/``offsetof``/
  ``_Alignof`` of every struct and field the bindings declare and the value of every enum, flag
  and error code they use, and compare with the ctypes declarations — any difference fails;
* compile a C++ probe with ``c++`` that prints each bound function's parameter list as the ABI
  sees it (integer of n bytes, pointer to n bytes, opaque pointer) and compare with the ctypes
  prototypes;
* call the real library with no GPU present and check that the driver turns the real codes into
  named unisleep errors that say what is missing;
* check which runtime is chosen when one is already loaded, and that a second one is refused.

* read AMD's own bindings, hip-python 6.2 and 7.2 (compiled against those ROCm releases'
  headers), and compare the HIP >= 5.3 struct layout, values and prototypes — parameter names
  included — with the bindings (``make test`` installs both releases beside the environment).

What they cannot show: anything that needs a GPU (every memory call returns hipErrorInvalidDevice
here).
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from sim import abi_check, abi_probe
from unisleep.backends.rocm import hip

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
INSTALL = "apt-get install libamdhip64-5 libamdhip64-dev (make test does it when run as root)"


def _include_dir():
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm", "/usr"):
        if root and os.path.exists(os.path.join(root, "include", "hip", "hip_runtime_api.h")):
            return os.path.join(root, "include")
    return None


def _system_library():
    found = sorted(glob.glob("/usr/lib/*/libamdhip64.so.5")) + sorted(glob.glob("/opt/rocm*/lib/libamdhip64.so"))
    return os.path.realpath(found[0]) if found else None


INCLUDE = _include_dir()
SYSTEM_LIB = _system_library()
needs_header = pytest.mark.skipif(INCLUDE is None, reason=f"needs the HIP header hip/hip_runtime_api.h: {INSTALL}")
needs_lib = pytest.mark.skipif(SYSTEM_LIB is None, reason=f"needs the HIP runtime libamdhip64.so.5: {INSTALL}")
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler: apt-get install gcc")
needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler: apt-get install g++")


def _gpu_present() -> bool:
    return os.path.exists("/dev/kfd") and bool(glob.glob("/dev/dri/renderD*"))


# ---------------------------------------------------------------------------- bindings vs header
# ROCm 6.x headers mark hipHostMalloc/hipHostFree deprecated: the probes name them on purpose
HIP_FLAGS = ["-D__HIP_PLATFORM_AMD__", "-Wno-deprecated-declarations"]


def bindings_layout(runtime_version: int) -> dict:
    return abi_probe.binding_layout(hip.structs(runtime_version), hip.ENUMS)


def bindings_prototypes(runtime_version: int) -> dict:
    return abi_probe.binding_prototypes(hip.prototypes(hip.alloc_prop_type(runtime_version)))


def header_layout(tmp_path, include_dirs=None) -> dict:
    """The C probe against the header; the header's HIP_VERSION picks which hipMemAllocationProp
    layout of the bindings is asked for (5.2's or >= 5.3's)."""
    flags = HIP_FLAGS + [f"-I{d}" for d in (include_dirs or [INCLUDE])]
    out = abi_probe.c_layout_probe(
        tmp_path, "hip/hip_runtime_api.h", flags, bindings_layout(hip.PROP_LAYOUT_CHANGED), "HIP_VERSION",
        legacy=(hip.PROP_LAYOUT_CHANGED, bindings_layout(hip.PROP_LAYOUT_CHANGED - 1)))
    out["HIP_VERSION"] = out.pop("VERSION")
    return out


def header_prototypes(tmp_path, include_dirs=None) -> dict:
    # the header's C++ overloads (templates of hipHostMalloc...) hidden: the C functions are compared
    flags = HIP_FLAGS + ["-D__HIP_DISABLE_CPP_FUNCTIONS__"] + [f"-I{d}" for d in (include_dirs or [INCLUDE])]
    return abi_probe.cxx_prototype_probe(tmp_path, "hip/hip_runtime_api.h", flags, hip.PROTOTYPES)


_diff = abi_probe.diff


# ---------------------------------------------------------------------------- tests
@needs_lib
def test_real_library_loads_through_the_driver_loader_and_has_every_function():
    lib = hip.load_library()  # the driver's own loader (nothing else loaded libamdhip64 here)
    assert os.path.basename(lib.unisleep_path).startswith("libamdhip64.so")
    api = hip.HipApi(lib)  # raises PlatformError naming any function the library lacks
    for name in hip.prototypes(api.Prop):
        addr = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        assert addr, f"{name} resolved to NULL in {lib.unisleep_path}"
        assert callable(getattr(api, name))
    assert api.runtime_version >= 50200000  # hipRuntimeGetVersion works without a GPU
    assert api.Prop is hip.alloc_prop_type(api.runtime_version)


@needs_lib
def test_a_missing_function_is_a_named_error():
    """The control for the test above: a table naming a function the real library lacks fails."""
    from unisleep.backends._native import bind_prototypes

    class T:
        pass

    lib = hip.load_library()
    assert bind_prototypes(T(), lib, {"hipMemNoSuchCall": (ctypes.c_int, [])}) == ["hipMemNoSuchCall"]


@pytest.mark.slow
@needs_header
@needs_cc
def test_structs_enums_and_codes_match_the_real_header(tmp_path):
    theirs = header_layout(tmp_path)
    version = theirs.pop("HIP_VERSION")
    ours = bindings_layout(version)
    assert len(ours) > 40  # every struct, field and code is really compared
    problems = _diff(ours, theirs)
    assert not problems, (f"the ctypes declarations in backends/rocm/hip.py differ from {INCLUDE}/hip "
                          f"(HIP_VERSION {version}):\n  " + "\n  ".join(problems))


@pytest.mark.slow
@needs_header
@needs_cxx
def test_prototypes_match_the_real_header(tmp_path):
    """Each function's parameters as the ABI sees them and by the header's names, in order:
    two same-class parameters swapped (hipMemMap size/offset, hipMemcpy dst/src) differ."""
    with open(os.path.join(INCLUDE, "hip", "hip_runtime_api.h")) as f:
        names = abi_probe.header_parameter_names(f.read(), hip.PARAM_NAMES)
    theirs = abi_probe.with_names(header_prototypes(tmp_path), names)
    # pointers to hipMemAllocationProp: same size in both layouts (the layout is checked above)
    ours = abi_probe.binding_signatures(hip.signatures())
    problems = _diff(ours, theirs)
    assert not problems, "the ctypes prototypes in backends/rocm/hip.py differ from the header:\n  " + "\n  ".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("release", sorted(abi_check.HIP_PYTHON_RELEASES))
def test_bindings_match_hip_python(release):
    """The HIP >= 5.3 layout every ROCm 6.x/7.x user gets, checked against AMD's own bindings
    of that release: struct sizes and field offsets, every value, every prototype by name."""
    ref = abi_check.hip_python_reference(release)
    if ref is None:
        pytest.skip(f"needs hip-python {abi_check.HIP_PYTHON_RELEASES[release]} in {abi_check.hip_python_dir(release)}: "
                    + abi_check.HIP_PYTHON_INSTALL.format(release=release, version=abi_check.HIP_PYTHON_RELEASES[release]))
    assert ref["HIP_VERSION"] >= hip.PROP_LAYOUT_CHANGED
    structs, enums, signatures = abi_check.hip_declarations(ref["HIP_VERSION"])
    assert structs["hipMemAllocationProp"] is hip.hipMemAllocationProp  # the >= 5.3 layout is the one compared
    assert len(ref["layout"]) >= 30 and len(ref["values"]) == len(enums) and set(ref["prototypes"]) == set(signatures)
    problems = abi_check.hip_problems(ref, structs, enums, signatures)
    assert not problems, (f"backends/rocm/hip.py differs from hip-python {ref['hip_python']} (HIP_VERSION "
                          f"{ref['HIP_VERSION']}):\n  " + "\n  ".join(problems))


@needs_lib
def test_real_error_names_match_the_library():
    lib = ctypes.CDLL(hip.load_library().unisleep_path)
    lib.hipGetErrorName.restype = ctypes.c_char_p
    lib.hipGetErrorName.argtypes = [ctypes.c_int]
    for code, name in hip.ERROR_NAMES.items():
        assert lib.hipGetErrorName(code).decode() == name


@needs_lib
@pytest.mark.skipif(_gpu_present(), reason="an AMD GPU is present: the no-GPU error path cannot be shown")
def test_no_gpu_real_codes_become_named_errors():
    from unisleep.backends.rocm import RocmDriver

    api = hip.HipApi(hip.load_library())
    n = ctypes.c_int(-1)
    assert api.hipGetDeviceCount(ctypes.byref(n)) == hip.hipErrorNoDevice  # the real code, not ours
    with pytest.raises(hip.HipNoDeviceError) as e:
        RocmDriver(env={})  # loads the real library itself
    msg = str(e.value)
    assert "sees no AMD GPU" in msg and "hipErrorNoDevice" in msg and "/dev/kfd is missing" in msg
    assert hip.version_text(api.runtime_version) in msg and "libamdhip64" in msg
    assert 'MemoryLifecycle("host")' in msg
    # every other call the driver makes gets hipErrorInvalidDevice: named, and says what is missing
    p = ctypes.c_void_p()
    for call, args in (("hipSetDevice", (0,)), ("hipMemAddressReserve", (ctypes.byref(p), 2 << 20, 0, None, 0))):
        with pytest.raises(hip.HipError, match=rf"{call} failed with hipErrorInvalidDevice \(101\): .*no usable AMD GPU.*/dev/kfd"):
            api.call(call, *args)


def _run(code: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("UNISLEEP_HIP_LIBRARY", None)
    env.update(env_extra or {})
    prelude = f"import ctypes, json, sys\nsys.path.insert(0, {TESTS!r})\nfrom unisleep.backends.rocm import hip\n"
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


LOAD = """
try:
    lib = hip.load_library()
    print(json.dumps({"path": lib.unisleep_path, "chosen": lib.unisleep_chosen}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "msg": str(e)}))
"""


@pytest.mark.slow
@needs_lib
def test_the_runtime_already_in_the_process_wins(tmp_path):
    copy = tmp_path / "other-rocm" / "libamdhip64.so"
    copy.parent.mkdir()
    shutil.copy(SYSTEM_LIB, copy)
    # nothing loaded: the search finds the system's
    r = _run(LOAD)
    assert r.get("path") == SYSTEM_LIB, r
    # another copy already loaded (as torch would have): it is used, although the search would
    # have found the system's first
    r = _run(f"ctypes.CDLL({str(copy)!r}, mode=ctypes.RTLD_GLOBAL)\n" + LOAD)
    assert r.get("path") == str(copy) and r.get("chosen") == "already loaded in this process", r
    # an override naming a different file than the loaded one is refused, naming both
    r = _run(f"ctypes.CDLL({str(copy)!r}, mode=ctypes.RTLD_GLOBAL)\n" + LOAD, {"UNISLEEP_HIP_LIBRARY": SYSTEM_LIB})
    assert r.get("error") == "PlatformError" and str(copy) in r["msg"] and SYSTEM_LIB in r["msg"], r
    assert "two different HIP runtimes" in r["msg"]
    # two different copies already loaded: refused, naming both
    r = _run(f"ctypes.CDLL({SYSTEM_LIB!r}, mode=ctypes.RTLD_GLOBAL)\n"
             f"ctypes.CDLL({str(copy)!r}, mode=ctypes.RTLD_GLOBAL)\n" + LOAD)
    assert r.get("error") == "PlatformError" and str(copy) in r["msg"] and SYSTEM_LIB in r["msg"], r
    # nothing loaded, an override: used
    r = _run(LOAD, {"UNISLEEP_HIP_LIBRARY": str(copy)})
    assert r.get("path") == str(copy) and r.get("chosen") == "the override", r


@needs_lib
@pytest.mark.skipif(_gpu_present(), reason="an AMD GPU is present: the refused-probe path cannot be shown")
def test_rereserve_probe_on_the_real_library_keeps_reservations_when_refused(monkeypatch):
    """What can be shown of the free-and-re-reserve step without a GPU: the probe's real calls
    (hipMemAddressReserve of one granule) are refused by the real runtime, and the driver then
    keeps reservations — it never frees a region's address it might not get back."""
    import threading

    from unisleep.backends import _native
    from unisleep.backends.rocm import RocmDriver

    monkeypatch.setattr(_native, "_FALLBACKS", [])  # this process's record, restored afterwards
    drv = RocmDriver.__new__(RocmDriver)  # no GPU: __init__ stops at HipNoDeviceError (tested above)
    drv.api = hip.HipApi(hip.load_library())
    drv.device, drv._gran, drv._tls = 0, 2 << 20, threading.local()
    drv.kept_reason, drv._probed, drv.rereserve_on_sleep = None, False, True
    drv._probe_rereserve()
    assert drv._probed and "could not reserve 2097152 bytes (hipErrorInvalidDevice)" in drv.kept_reason
    assert any(drv.kept_reason in m for m in _native.fallback_warnings())
