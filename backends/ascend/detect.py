"""Whether this machine has Ascend NPUs (torch_npu installed and ``/dev/davinci*`` device nodes,
read without creating a device context), and the settings known to break NPU sleep mode."""

from __future__ import annotations

import glob
import os
from typing import Optional

from unisleep.backend import Detection, DeviceInfo, module_present

#: the expandable-segments advice on Ascend (``Backend.expandable_note``)
EXPANDABLE_NOTE = (
    "unisleep turns expandable segments off inside its pools, but vllm-ascend's own CaMemAllocator refuses to start "
    "with them (vllm-ascend sets them unless --enable-sleep-mode); remove expandable_segments:True when "
    "vllm-ascend's sleep mode is used.")


def detect() -> Optional[Detection]:
    nodes = sorted(glob.glob("/dev/davinci[0-9]*"))
    if not module_present("torch_npu") or not nodes:
        return None
    devs = tuple(DeviceInfo(i, f"Ascend NPU ({os.path.basename(n)})") for i, n in enumerate(nodes))
    return Detection(f"torch_npu is installed and {len(nodes)} Ascend device node(s) exist", devs)


def environment_warnings() -> list[str]:
    warn = []
    if os.environ.get("VLLM_ASCEND_ENABLE_NZ", "") not in ("0",):
        warn.append("VLLM_ASCEND_ENABLE_NZ is not 0: FRACTAL_NZ weights cannot be updated by RL; export VLLM_ASCEND_ENABLE_NZ=0.")
    if not os.environ.get("HCCL_HOST_SOCKET_PORT_RANGE") or not os.environ.get("HCCL_NPU_SOCKET_PORT_RANGE"):
        warn.append(
            "HCCL_HOST_SOCKET_PORT_RANGE / HCCL_NPU_SOCKET_PORT_RANGE are unset: two processes sharing an NPU "
            "(trainer + engine) need disjoint ranges, e.g. export HCCL_HOST_SOCKET_PORT_RANGE=auto HCCL_NPU_SOCKET_PORT_RANGE=auto."
        )
    return warn
