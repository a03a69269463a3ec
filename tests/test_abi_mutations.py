"""The ABI checks can fail: each test hands the same comparison that checks the real bindings
(tests/test_hip_real.py, tests/test_ascend_sim.py) a copy of the declarations with one mistake —
a field moved or widened, an enumerator changed, two arguments of the same class swapped, an
argument widened — and the comparison must name it.  ROCm >= 5.3 against AMD's hip-python 6.2
and 7.2; ACL against the header generated from CANN 9.1.0's table."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_ulonglong, c_void_p

import pytest

from sim import abi_check
from unisleep.backends.ascend import acl
from unisleep.backends.rocm import hip


def _struct(name, fields):
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def _swap(signatures, fn, i, j):
    res, params = signatures[fn]
    params = list(params)
    params[i], params[j] = params[j], params[i]
    return {**signatures, fn: (res, params)}


def _retype(signatures, fn, i, ctype):
    res, params = signatures[fn]
    params = list(params)
    params[i] = (params[i][0], ctype)
    return {**signatures, fn: (res, params)}


# ---------------------------------------------------------------------------- ROCm >= 5.3
def _prop(fields):
    return _struct("hipMemAllocationProp", fields)


FLAGS = hip._AllocFlags
PROP_SWAPPED = _prop([("requestedHandleType", c_int), ("type", c_int), ("location", hip.hipMemLocation),
                      ("win32HandleMetaData", c_void_p), ("allocFlags", FLAGS)])
FLAGS_WIDE = _struct("_AllocFlags", [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                                     ("usage", c_uint)])
PROP_WIDE_USAGE = _prop([("type", c_int), ("requestedHandleType", c_int), ("location", hip.hipMemLocation),
                         ("win32HandleMetaData", c_void_p), ("allocFlags", FLAGS_WIDE)])
LOC_SWAPPED = _struct("hipMemLocation", [("id", c_int), ("type", c_int)])


def _hip_mutations():
    """name -> (mutate(structs, enums, signatures) -> same, a word the report must contain)."""
    return {
        "prop type/requestedHandleType swapped": (
            lambda st, en, sg: ({**st, "hipMemAllocationProp": PROP_SWAPPED}, en, sg), "hipMemAllocationProp.type"),
        "prop allocFlags.usage widened to unsigned int": (
            lambda st, en, sg: ({**st, "hipMemAllocationProp": PROP_WIDE_USAGE}, en, sg), "allocFlags.usage"),
        "hipMemLocation id/type swapped": (
            lambda st, en, sg: ({**st, "hipMemLocation": LOC_SWAPPED}, en, sg), "hipMemLocation.type"),
        "hipMemcpyDeviceToHost changed": (
            lambda st, en, sg: (st, {**en, "hipMemcpyDeviceToHost": 1}, sg), "hipMemcpyDeviceToHost"),
        "hipMemAccessFlagsProtReadWrite changed": (
            lambda st, en, sg: (st, {**en, "hipMemAccessFlagsProtReadWrite": 2}, sg), "hipMemAccessFlagsProtReadWrite"),
        "hipMemMap size/offset swapped": (lambda st, en, sg: (st, en, _swap(sg, "hipMemMap", 1, 2)), "hipMemMap"),
        "hipMemcpy dst/src swapped": (lambda st, en, sg: (st, en, _swap(sg, "hipMemcpy", 0, 1)), "hipMemcpy"),
        "hipMemset value widened to size_t": (lambda st, en, sg: (st, en, _retype(sg, "hipMemset", 1, c_size_t)),
                                              "hipMemset"),
        "hipMemCreate flags narrowed": (lambda st, en, sg: (st, en, _retype(sg, "hipMemCreate", 3, c_uint)),
                                        "hipMemCreate"),
        "hipMemAddressReserve alignment/size swapped": (
            lambda st, en, sg: (st, en, _swap(sg, "hipMemAddressReserve", 1, 2)), "hipMemAddressReserve"),
    }


@pytest.fixture(scope="module", params=sorted(abi_check.HIP_PYTHON_RELEASES))
def hip_ref(request):
    ref = abi_check.hip_python_reference(request.param)
    if ref is None:
        release = request.param
        pytest.skip(f"needs hip-python {abi_check.HIP_PYTHON_RELEASES[release]}: "
                    + abi_check.HIP_PYTHON_INSTALL.format(release=release, version=abi_check.HIP_PYTHON_RELEASES[release]))
    return ref


@pytest.mark.slow
def test_hip_unmutated_declarations_pass(hip_ref):
    assert abi_check.hip_problems(hip_ref, *abi_check.hip_declarations(hip_ref["HIP_VERSION"])) == []


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(_hip_mutations()))
def test_hip_mutation_is_caught(hip_ref, mutation):
    mutate, word = _hip_mutations()[mutation]
    problems = abi_check.hip_problems(hip_ref, *mutate(*abi_check.hip_declarations(hip_ref["HIP_VERSION"])))
    assert problems and any(word in p for p in problems), problems


@pytest.mark.slow
def test_hip_layout_switch_moved_past_the_release_is_caught(hip_ref, monkeypatch):
    """Raising PROP_LAYOUT_CHANGED would hand this release's runtime the HIP 5.2 layout."""
    monkeypatch.setattr(hip, "PROP_LAYOUT_CHANGED", hip_ref["HIP_VERSION"] + 1)
    problems = abi_check.hip_problems(hip_ref, *abi_check.hip_declarations(hip_ref["HIP_VERSION"]))
    assert any("hipMemAllocationProp.type" in p for p in problems), problems


# ---------------------------------------------------------------------------- ACL
ACL_LOC_SWAPPED = _struct("aclrtMemLocation", [("type", c_int), ("id", c_uint32)])


def _acl_prop(location=acl.aclrtMemLocation, reserve=c_uint64):
    return _struct("aclrtPhysicalMemProp", [("handleType", c_int), ("allocationType", c_int), ("memAttr", c_int),
                                            ("location", location), ("reserve", reserve)])


def _acl_with_prop(st, sg, prop, location=None):
    st = {**st, "aclrtPhysicalMemProp": prop}
    if location is not None:
        st["aclrtMemLocation"] = location
    sg = {n: (r, [(p, POINTER(prop) if t in (POINTER(acl.aclrtPhysicalMemProp),) else t) for p, t in a])
          for n, (r, a) in sg.items()}
    return st, sg


def _acl_mutations():
    def loc(st, en, sg):
        st, sg = _acl_with_prop(st, sg, _acl_prop(location=ACL_LOC_SWAPPED), ACL_LOC_SWAPPED)
        return st, en, sg

    def reserve(st, en, sg):
        st, sg = _acl_with_prop(st, sg, _acl_prop(reserve=c_uint32))
        return st, en, sg

    return {
        "aclrtMemLocation id/type swapped": (loc, "aclrtMemLocation.id"),
        "aclrtPhysicalMemProp.reserve narrowed to uint32": (reserve, "reserve"),
        "ACL_HBM_MEM_HUGE changed": (lambda st, en, sg: (st, {**en, "ACL_HBM_MEM_HUGE": 5}, sg), "ACL_HBM_MEM_HUGE"),
        "ACL_MEMCPY_DEVICE_TO_HOST changed": (lambda st, en, sg: (st, {**en, "ACL_MEMCPY_DEVICE_TO_HOST": 1}, sg),
                                              "ACL_MEMCPY_DEVICE_TO_HOST"),
        "aclrtMemcpy destMax/src swapped": (lambda st, en, sg: (st, en, _swap(sg, "aclrtMemcpy", 1, 2)), "aclrtMemcpy"),
        "aclrtMemcpy destMax/count swapped": (lambda st, en, sg: (st, en, _swap(sg, "aclrtMemcpy", 1, 3)), "aclrtMemcpy"),
        "aclrtMemset maxCount/count swapped": (lambda st, en, sg: (st, en, _swap(sg, "aclrtMemset", 1, 3)), "aclrtMemset"),
        "aclrtMapMem size/offset swapped": (lambda st, en, sg: (st, en, _swap(sg, "aclrtMapMem", 1, 2)), "aclrtMapMem"),
        "aclrtMemGetAllocationGranularity output first (CUDA's order)": (
            lambda st, en, sg: (st, en, _swap(sg, "aclrtMemGetAllocationGranularity", 0, 2)),
            "aclrtMemGetAllocationGranularity"),
        "aclrtUnmapMem given a size": (
            lambda st, en, sg: (st, en, {**sg, "aclrtUnmapMem": (c_int, [("virPtr", c_void_p), ("size", c_size_t)])}),
            "aclrtUnmapMem"),
        "aclrtReserveMemAddress flags narrowed": (
            lambda st, en, sg: (st, en, _retype(sg, "aclrtReserveMemAddress", 4, c_uint)), "aclrtReserveMemAddress"),
    }


@pytest.fixture(scope="module")
def acl_ref(tmp_path_factory):
    import shutil

    if shutil.which("cc") is None or shutil.which("c++") is None:
        pytest.skip("needs a C and a C++ compiler: apt-get install gcc g++")
    return abi_check.acl_reference_from_table(tmp_path_factory.mktemp("acl"), acl.STRUCTS, acl.ENUMS)


@pytest.mark.slow
def test_acl_unmutated_declarations_pass(acl_ref):
    assert abi_check.acl_problems(acl_ref, acl.STRUCTS, acl.ENUMS, acl.SIGNATURES) == []


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(_acl_mutations()))
def test_acl_mutation_is_caught(acl_ref, mutation):
    mutate, word = _acl_mutations()[mutation]
    problems = abi_check.acl_problems(acl_ref, *mutate(dict(acl.STRUCTS), dict(acl.ENUMS), dict(acl.SIGNATURES)))
    assert problems and any(word in p for p in problems), problems
