"""Whether this machine has AMD GPUs, read without creating a HIP context: a ROCm build of torch
(``torch.version.hip``) or ``/dev/kfd``, and the GPUs amdsmi sees, numbered as HIP numbers them
in this process."""

from __future__ import annotations

import os
from typing import Optional

from unisleep.backend import Detection, DeviceInfo, torch_version

from . import config


def amdsmi_devices() -> Optional[tuple[DeviceInfo, ...]]:
    """The AMD GPUs this process sees, through amdsmi, numbered as HIP numbers them here.

    amdsmi lists every GPU of the machine whatever ``HIP_VISIBLE_DEVICES`` /
    ``ROCR_VISIBLE_DEVICES`` say; each GPU's enumeration info gives its ``hip_id`` (its HIP
    index with all GPUs visible), to which the visible-device variables are applied
    (``backends/rocm/config.visible_devices``).  An amdsmi without enumeration info cannot be
    mapped: its GPUs are listed only when no visible-device variable is set.  ``amdsmi_shut_down``
    runs whatever happens once ``amdsmi_init`` succeeded.  amdsmi raises KeyError (not
    ImportError) without its library."""
    try:
        import amdsmi  # type: ignore
    except Exception:  # KeyError('libamd_smi.so') without the library, ImportError, OSError...
        return None
    try:
        amdsmi.amdsmi_init()
    except Exception:  # amdsmi cannot start: no AMD GPU seen this way (HIP decides)
        return None
    try:
        found = []
        for pos, h in enumerate(amdsmi.amdsmi_get_processor_handles()):
            try:
                info = amdsmi.amdsmi_get_gpu_enumeration_info(h)
                hip_id, uuid = int(info["hip_id"]), info.get("hip_uuid") or None
            except Exception:  # older amdsmi, or "N/A"
                hip_id, uuid = None, None
            try:
                name = amdsmi.amdsmi_get_gpu_asic_info(h).get("market_name", "AMD GPU")
            except Exception:  # a device amdsmi cannot name keeps a generic name
                name = "AMD GPU"
            total = used = None
            try:
                vram = amdsmi.amdsmi_get_gpu_vram_usage(h)  # MB
                total, used = vram["vram_total"] * 2**20, vram["vram_used"] * 2**20
            except Exception:  # sizes left unknown for this device
                pass
            found.append((hip_id, uuid, name, total, used, pos))
        if any(f[0] is None for f in found):
            if any(v in os.environ for v in config.VISIBLE_VARS):
                return ()  # which GPUs are visible cannot be told without hip_id
            found = [(pos, *rest) for (_, *rest), pos in zip(found, range(len(found)))]
        visible = config.visible_devices([(f[0], f[1]) for f in found])
        out = []
        for i, k in enumerate(visible):
            _, uuid, name, total, used, _ = found[k]
            out.append(DeviceInfo(i, name, total, None if total is None else total - used, uuid))
        return tuple(out)
    except Exception:  # amdsmi failed mid-listing: no list from it
        return None
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:  # shutting amdsmi down after the list: nothing depends on it
            pass


def detect() -> Optional[Detection]:
    hip = torch_version("hip")
    kfd = os.path.exists("/dev/kfd")
    if not hip and not kfd:
        return None
    devs = amdsmi_devices() or ()
    if not devs and not kfd:
        return None
    why = []
    if hip:
        why.append(f"torch is a ROCm build (HIP {hip})")
    if kfd:
        why.append("/dev/kfd exists")
    if devs:
        why.append(f"amdsmi sees {len(devs)} GPU(s)")
    return Detection(" and ".join(why), devs)
