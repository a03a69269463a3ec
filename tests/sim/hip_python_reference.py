"""Not a simulator: AMD's own HIP bindings (the ``hip-python`` package, one release per ROCm
version, compiled against that release's HIP headers) read as the reference for the ctypes
bindings' ABI, on a machine without ROCm.  Run as a script in a child process whose path holds
one hip-python release (``make test`` installs 6.2 and 7.2 side by side); prints JSON:

* ``HIP_VERSION`` of the headers the release was built from;
* ``layout``: ``sizeof``/``offsetof`` of every struct and (nested) field the bindings declare,
  measured through hip-python's compiled accessors — a field's setter writes the field's bytes
  at the header's offset (found by writing into a buffer of 0xFF), a nested struct's accessor
  returns its address; a member of an anonymous union hip-python does not expose is placed in
  the one gap of the union's size the named fields leave (else reported missing);
* ``values``: every enumerator, flag and error code the bindings use, from hip-python's enums
  and constants;
* ``prototypes``: each bound function's parameters (name, integer/pointer, width) as declared
  in hip-python's ``chip.pxd``, which is generated from the header.

Only names come from the bindings (``unisleep.backends.rocm.hip``); every number comes from
hip-python.  A name hip-python lacks is reported missing, never guessed.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys

C_INT_WIDTH = {"char": 1, "unsigned char": 1, "short": 2, "unsigned short": 2, "int": 4, "unsigned int": 4,
               "long": 8, "unsigned long": 8, "long long": 8, "unsigned long long": 8, "size_t": 8,
               "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8}


def _wrapper(hip, cname):
    return getattr(hip, cname)


def _measure_struct(hip, cname: str, cls, out: dict, base_wrapper=None, base_addr=None, path: str = "") -> None:
    """Fill ``out`` with the layout of ``cls``'s fields as hip-python's ``cname`` lays them out."""
    top = base_wrapper is None
    if top:
        W = _wrapper(hip, cname)
        size = W().c_sizeof()
        buf = (ctypes.c_ubyte * (size + 64))()
        base_addr = ctypes.addressof(buf)
        base_wrapper = W.fromObj(buf)
        assert int(base_wrapper) == base_addr
        out[f"sizeof {cname}"] = size
        out["_buf"] = buf
    buf = out["_buf"]
    w = base_wrapper
    start = int(w) - base_addr
    for name, ctype in cls._fields_:
        key = path + name
        if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
            try:
                sub = getattr(w, "get_" + name)(0)
            except AttributeError:
                continue
            out[f"offsetof {cname}.{key}"] = int(sub) - base_addr
            out[f"sizeof {cname}.{key}"] = sub.c_sizeof()
            _measure_struct(hip, cname, ctype, out, sub, base_addr, key + ".")
            continue
        if not hasattr(type(w), name):
            continue  # an anonymous union member: placed by elimination below
        ctypes.memset(base_addr, 0, len(buf))
        zero = getattr(w, name)  # the field's type: an enum member of value 0, an int, a pointer
        ctypes.memset(base_addr, 0xFF, len(buf))
        setattr(w, name, zero)
        changed = [i for i in range(len(buf)) if buf[i] != 0xFF]
        if not changed or changed != list(range(changed[0], changed[-1] + 1)):
            raise RuntimeError(f"cannot measure {cname}.{key}: bytes {changed} changed")
        out[f"offsetof {cname}.{key}"] = changed[0]
        out[f"sizeof {cname}.{key}"] = len(changed)
    if top:
        _place_union_members(hip, cname, cls, out)
        del out["_buf"]


def _place_union_members(hip, cname: str, cls, out: dict) -> None:
    """A member of an anonymous union that hip-python does not expose (``requestedHandleType``
    in HIP >= 7) is placed in the gap between the named fields around it, when that gap is
    exactly the size of hip-python's union type holding the member; otherwise it stays
    unmeasured and the comparison reports it."""
    names = [n for n, _ in cls._fields_]
    for i, name in enumerate(names):
        if f"offsetof {cname}.{name}" in out:
            continue
        holders = [getattr(hip, a) for a in dir(hip) if a.startswith(cname + "_union_")
                   and hasattr(getattr(hip, a), name)]
        if len(holders) != 1:
            continue
        n = holders[0]().c_sizeof()
        before = [m for m in names[:i] if f"offsetof {cname}.{m}" in out]
        after = [m for m in names[i + 1:] if f"offsetof {cname}.{m}" in out]
        lo = (out[f"offsetof {cname}.{before[-1]}"] + out[f"sizeof {cname}.{before[-1]}"]) if before else 0
        hi = out[f"offsetof {cname}.{after[0]}"] if after else out[f"sizeof {cname}"]
        if hi - lo == n:
            out[f"offsetof {cname}.{name}"] = lo
            out[f"sizeof {cname}.{name}"] = n


def _values(hip, names) -> dict:
    enums = [getattr(hip, a) for a in dir(hip)]
    enums = [e for e in enums if isinstance(e, type) and hasattr(e, "__members__")]
    out = {}
    for name in names:
        if isinstance(getattr(hip, name, None), int) and not isinstance(getattr(hip, name), bool):
            out[f"value {name}"] = int(getattr(hip, name))
            continue
        for e in enums:
            if name in e.__members__:
                out[f"value {name}"] = int(e.__members__[name].value)
                break
    return out


def _pxd_types(pxd: str):
    """Typedefs (name -> C type), enum names and struct names declared in chip.pxd."""
    typedefs, enums, structs = {}, set(), set()
    for m in re.finditer(r"^\s*ctypedef\s+(.+?)\s+(\w+)\s*$", pxd, re.M):
        typedefs[m.group(2)] = m.group(1)
    for m in re.finditer(r"^\s*(?:cdef|ctypedef)\s+enum\s+(\w+)", pxd, re.M):
        enums.add(m.group(1))
    for m in re.finditer(r"^\s*(?:cdef|ctypedef)\s+(?:struct|union)\s+(\w+)", pxd, re.M):
        structs.add(m.group(1))
    return typedefs, enums, structs


def _abi(ctype: str, typedefs, enums, struct_size) -> list:
    t = re.sub(r"\bconst\b", "", ctype).strip()
    t = re.sub(r"\s+", " ", t).replace(" *", "*").strip()
    if t.endswith("*"):
        pointee = t[:-1].strip()
        while pointee in typedefs and not pointee.endswith("*"):
            pointee = re.sub(r"\bconst\b", "", typedefs[pointee]).strip().replace(" *", "*")
        if pointee == "void" or pointee in ("struct",):
            return ["ptr", None]
        if pointee.endswith("*"):
            return ["ptr", 8]
        if pointee in C_INT_WIDTH:
            return ["ptr", C_INT_WIDTH[pointee]]
        if pointee in enums:
            return ["ptr", 4]
        if pointee in struct_size:
            return ["ptr", struct_size[pointee]]
        return ["ptr", None]  # an incomplete (opaque) type
    while t in typedefs:
        t = re.sub(r"\bconst\b", "", typedefs[t]).strip().replace(" *", "*")
        if t.endswith("*"):
            return ["ptr", None]
    if t in enums:
        return ["int", 4]
    if t in C_INT_WIDTH:
        return ["int", C_INT_WIDTH[t]]
    return ["other", None]


def _prototypes(pxd: str, names, struct_size) -> dict:
    typedefs, enums, _ = _pxd_types(pxd)
    out = {}
    for name in names:
        m = re.search(r"^cdef\s+(\w+)\s+" + name + r"\(([^)]*)\)", pxd, re.M)
        if m is None:
            continue
        params = []
        for p in [p.strip() for p in m.group(2).split(",") if p.strip()]:
            pm = re.match(r"(.*?)(\w+)$", p)
            ptype, pname = pm.group(1).strip(), pm.group(2)
            params.append([pname] + _abi(ptype, typedefs, enums, struct_size))
        out[name] = [_abi(m.group(1), typedefs, enums, struct_size), params]
    return out


def reference() -> dict:
    import hip as hip_pkg
    from hip import hip

    from unisleep.backends.rocm import hip as ours

    structs = ours.structs(ours.PROP_LAYOUT_CHANGED)
    layout: dict = {}
    for cname, cls in structs.items():
        if hasattr(hip, cname):
            _measure_struct(hip, cname, cls, layout)
    struct_size = {c: layout[f"sizeof {c}"] for c in structs if f"sizeof {c}" in layout}
    pxd = open(os.path.join(os.path.dirname(hip_pkg.__file__), "chip.pxd")).read()
    return {
        "hip_python": getattr(hip_pkg, "__version__", None) or _version(hip_pkg),
        "HIP_VERSION": int(hip_pkg.HIP_VERSION),
        "layout": layout,
        "values": _values(hip, ours.ENUMS),
        "prototypes": _prototypes(pxd, ours.PARAM_NAMES, struct_size),
    }


def _version(pkg) -> str:
    from hip import _version

    return _version.VERSION


if __name__ == "__main__":
    json.dump(reference(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
