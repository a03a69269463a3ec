"""The ``unisleep`` weight-transfer engine for vLLM: receives weights over :mod:`unisleep.transfer`.

Registered by :mod:`unisleep.vllm_plugin`; selected with
``--weight-transfer-config '{"backend": "unisleep"}'`` (or ``LLM(...,
weight_transfer_config={"backend": "unisleep"})``).  It runs vLLM's own protocol
(``/init_weight_transfer_engine`` → ``/start_weight_update`` → ``/update_weights`` ×N →
``/finish_weight_update``) on every platform unisleep supports, CPU included: the bytes travel over
a private :class:`~unisleep.transfer.TransferGroup` (gloo on host, the platform's collective on
accelerators), never over the worker's own process group.

Differences from vLLM's built-in engines, on purpose:

* **Staging in host memory by default.**  Each verified bucket is copied at once into pinned host
  memory (plain host memory on CPU); the transfer itself holds two bucket buffers on the device,
  so an update never needs a second copy of the model there.  ``init_info.staging="device"``
  (opt-in) keeps the staged copy on the device instead — faster to apply, and refused at
  ``start_weight_update`` unless the update (sized from the checkpoint) fits in 90 % of the free
  device memory.

* **Atomic.**  ``update_weights`` receives into host-side staging (the receiver verifies every
  tensor against the sender's manifest and checksums); the model is touched only in
  ``finish_weight_update``, and only when the staged set covers every tensor of the checkpoint
  the engine was loaded from (names and shapes), unless the update says ``partial``.  A failed,
  corrupt or incomplete update therefore leaves the served weights exactly as they were and the
  engine usable — vLLM's engines leave the model in meta-tensor state, which kills the engine at
  the next forward.
* **No accelerator sync on host.**  The base ``update_weights`` calls
  ``torch.accelerator.synchronize()``, which raises on CPU.
* **Refuses to write into sleeping weights** (vLLM #57853), before anything is received and
  again before the apply: with sleep mode on, the update goes ahead only when the allocator that
  holds the weights (unisleep's, vLLM's, or a platform plugin's) reports them awake; when none
  can tell, it refuses and says why (fail closed).

init_info: ``{"rendezvous": "tcp://127.0.0.1:PORT", "rank_offset": 1, "world_size": 2,
"timeout_s": 300, "secret_file": "/path/of/a/0600/file", "staging": "host"}`` — worker rank = ``rank_offset +
dp_index * tp_pp_size + worker rank``; the trainer is rank 0.  The group secret travels as a file
path (or ``UNISLEEP_TRANSFER_SECRET_FILE`` in the engine's environment), never as the secret:
every control record of the group is authenticated with it (docs/security.md).  update_info:
``{"version": str|None, "final": true, "partial": false, "allow_equal_versions": false}`` —
versions must increase from one update to the next (the chunks of one update share theirs);
``{"abort": true}`` drops what was staged and closes vLLM's update session (vLLM has no abort
route: the call answers with an error naming :data:`ABORTED`, and the worker closes the session
as it does for every failed chunk).
The apply step uses vLLM's ``initialize_layerwise_reload`` → ``model.load_weights`` →
``finalize_layerwise_reload``, as its own checkpoint-format engines do.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..errors import InvalidTransitionError, TransferError

log = logging.getLogger(__name__)

#: raised by ``update_weights`` for ``{"abort": true}``: vLLM's worker then closes its update
#: session (it does so for any error in update_weights), and the staging is dropped
from .vllm_http import UPDATE_ABORTED as ABORTED  # noqa: E402  (the adapters look for it)

RESTART_REQUIRED = ("the vLLM engine must be restarted: applying the verified update failed "
                    "after the model entered layerwise-reload state")


@dataclass
class UnisleepInitInfo(WeightTransferInitInfo):
    rendezvous: str = ""
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = 300.0
    group_name: str = "vllm"
    secret_file: str = ""    # path of the group secret (mode 0600), never the secret itself
    insecure: bool = False   # a non-loopback group without a secret (warns)
    staging: str = "host"    # "host" (pinned on accelerators) or "device" (opt-in, fit-checked)


@dataclass
class UnisleepUpdateInfo(WeightTransferUpdateInfo):
    version: Optional[str] = None   # expected version of this chunk (checked against the sender)
    final: bool = True              # last chunk: check coverage now
    partial: bool = False           # allow an update that covers only some tensors
    abort: bool = False             # drop the staged tensors and close the session; receives nothing
    allow_equal_versions: bool = False  # accept a version equal to the one applied last


STAGING = ("host", "device")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_nbytes(model_path: str) -> Optional[int]:
    """Bytes of every tensor in the safetensors checkpoint at ``model_path`` (headers only), or
    None when that cannot be told (no local safetensors checkpoint, an unknown dtype)."""
    if not model_path or not os.path.isdir(model_path):
        return None
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                size = _DTYPE_BYTES.get(str(sl.get_dtype()))
                if size is None:
                    return None
                n = 1
                for d in sl.get_shape():
                    n *= int(d)
                total += n * size
    return total


def checkpoint_specs(model_path: str) -> Optional[dict[str, tuple[int, ...]]]:
    """name -> shape of every tensor in the safetensors checkpoint at ``model_path`` (headers
    only), or None when the path is not a local safetensors checkpoint."""
    if not model_path or not os.path.isdir(model_path):
        return None
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                out[k] = tuple(sf.get_slice(k).get_shape())
    return out


class UnisleepWeightTransferEngine(WeightTransferEngine[UnisleepInitInfo, UnisleepUpdateInfo]):
    init_info_cls = UnisleepInitInfo
    update_info_cls = UnisleepUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        from .vllm_async import register_worker_methods

        register_worker_methods()  # memory figures by method name (no insecure serialization)
        self.group = None
        self._staged: dict[str, torch.Tensor] = {}
        self._verified = False
        self._active = False
        self.last_version: Optional[str] = None
        self._session_version: Any = None
        self._floor: Any = None  # transfer version of the update applied last (in this group)
        self.applied_versions: list[Optional[str]] = []
        self.staging = "host"  # where update_weights stages the received tensors (init_info)
        # checkpoint specs per update target (the model's, the draft's): keyed by checkpoint path
        self._expected: dict[str, dict[str, tuple[int, ...]]] = {}

    # ---- helpers --------------------------------------------------------------------
    def _worker_rank(self, info: UnisleepInitInfo) -> int:
        pc = self.parallel_config
        return (info.rank_offset + getattr(pc, "data_parallel_index", 0) * pc.world_size
                + getattr(pc, "rank", 0))

    def _expected_specs(self) -> Optional[dict[str, tuple[int, ...]]]:
        """Specs of the checkpoint of the current update target: the model's, or the draft's
        after vLLM's ``set_weight_update_target`` (a draft update is checked against the draft)."""
        path = str(getattr(self.model_config, "model", "") or "")
        if path not in self._expected:
            try:
                self._expected[path] = checkpoint_specs(path) or {}
            except Exception as e:  # unreadable checkpoint: no coverage check possible
                log.warning("unisleep: cannot read checkpoint names for coverage checks: %s", e)
                self._expected[path] = {}
        return self._expected[path] or None

    def _check_weights_awake(self) -> None:
        """Fail closed: with sleep mode on, refuse unless the allocator holding the weights says
        they are awake (read from the engine's own model config: a draft's says nothing)."""
        mc = getattr(self, "_default_model_config", self.model_config)
        if not getattr(mc, "enable_sleep_mode", False):
            return  # vLLM keeps no sleep pools: the weights are never released
        from .vllm_allocator import vllm_weights_asleep

        asleep, how = vllm_weights_asleep()
        if asleep is None:
            raise InvalidTransitionError(
                f"refusing the weight update: sleep mode is on and this worker cannot establish that "
                f"its weights are awake ({how}); an update into sleeping weights kills the engine "
                "(vLLM #57853). Wake the weights (wake_up(['weights'])) and make sure the worker's "
                "sleep-mode allocator is the one holding them. Nothing was received.")
        if asleep:
            raise InvalidTransitionError(
                "wake the weights first: they are asleep in this worker and a weight update "
                f"would write into unmapped memory (vLLM #57853; {how}). Nothing was received.")

    # ---- WeightTransferEngine --------------------------------------------------------
    def init_transfer_engine(self, init_info: UnisleepInitInfo) -> None:
        from ..transfer import TransferGroup

        if not init_info.rendezvous:
            raise ValueError("init_info.rendezvous is required (tcp://HOST:PORT of the trainer)")
        if init_info.staging not in STAGING:
            raise ValueError(f"init_info.staging must be one of {STAGING}, got {init_info.staging!r}")
        self.staging = init_info.staging
        if self.group is not None:
            self.shutdown()
        rank = self._worker_rank(init_info)
        self._floor = self._session_version = None  # a new group: its update numbers start again
        self.group = TransferGroup.create(init_info.rendezvous, rank=rank,
                                          world_size=init_info.world_size,
                                          timeout_s=init_info.timeout_s,
                                          name=init_info.group_name,
                                          secret_file=init_info.secret_file or None,
                                          insecure=bool(init_info.insecure))
        log.info("unisleep weight transfer: joined %s as rank %d/%d", init_info.rendezvous,
                 rank, init_info.world_size)

    def start_weight_update(self) -> None:
        if self.group is None:
            raise RuntimeError("unisleep weight transfer not initialized: call "
                               "init_weight_transfer_engine first")
        self._check_weights_awake()
        if self.staging == "device":
            self._check_device_staging_fits()
        self._staged = {}
        self._verified = False
        self._active = True
        self._session_version = None  # version of this session's chunks (set by the first)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class would call torch.accelerator.synchronize(), which raises on host
        typed = self.parse_update_info(update_info)
        if typed.abort:
            self._staged = {}
            self._verified = False
            self._active = False
            # vLLM has no abort route; an error here makes the worker close the session
            raise RuntimeError(f"{ABORTED}; nothing was applied and the served weights are unchanged")
        try:
            self.receive_weights(typed)
        except BaseException:
            self._staged = {}   # the worker aborts the session; drop the partial staging
            self._verified = False
            self._active = False
            raise
        if self.device.type != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize()

    def _check_device_staging_fits(self) -> None:
        """Device staging holds a whole update on the device: refuse it, before anything is
        received, unless the update (sized from the target's checkpoint) fits in free memory."""
        from ..backup import host_available_bytes
        from ..units import human_bytes

        need = checkpoint_nbytes(str(getattr(self.model_config, "model", "") or ""))
        if need is None:
            raise TransferError("device staging needs the update's size, read from a local safetensors "
                                "checkpoint, and there is none: use staging='host' (the default). "
                                "Nothing was received.")
        if self.device.type == "cpu":
            free = host_available_bytes()
        else:
            free = int(torch.accelerator.get_memory_info(self.device)[0])
        if not free or need > 0.9 * free:
            raise TransferError(
                f"device staging of {human_bytes(need)} does not fit: {human_bytes(free)} is free on "
                f"{self.device} (90 % may be used); use staging='host' (the default, pinned host "
                "memory). Nothing was received.")

    def _stage(self, named: list) -> None:
        """Keep one verified bucket's tensors (views of transfer memory, valid during the call):
        in pinned host memory (accelerators; plain host memory on CPU) or, when opted in, as a
        device copy."""
        pin = self.staging == "host" and self.device.type != "cpu"
        for name, t in named:
            t = t.detach()
            if self.staging == "device":
                self._staged[name] = t.clone()
            else:
                dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                dst.copy_(t, non_blocking=pin)  # into pinned memory: one wait for the bucket below
                self._staged[name] = dst
        if pin:  # the views of transfer memory are reused once this returns
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: UnisleepUpdateInfo) -> None:
        from ..transfer import WeightReceiver

        if not self._active:
            raise RuntimeError("update_weights without start_weight_update")
        t0 = time.perf_counter()
        # versions increase from one update to the next; the chunks of one update share theirs
        # staged=False: each verified bucket goes straight to this engine's own staging (host by
        # default), so the transfer holds two bucket buffers on the device, not a second copy
        # of the update; atomicity comes from that staging (the model is touched in finish)
        if self._session_version is None:
            rx = WeightReceiver(self.group, apply=self._stage, initial_version=self._floor,
                                allow_equal_versions=update_info.allow_equal_versions, staged=False)
        else:
            rx = WeightReceiver(self.group, apply=self._stage, initial_version=self._session_version,
                                allow_equal_versions=True, staged=False)
        report = rx.receive()
        tag = getattr(report, "version", None)
        # the sender's transfer version is "<update number>:<label>" (VLLMWeightPusher): the
        # number increases from update to update, the label is vLLM's weight version
        got = str(tag).split(":", 1)[1] if isinstance(tag, str) and ":" in tag else tag
        if update_info.version is not None and got is not None and str(got) != update_info.version:
            raise TransferError(f"the sender sent version {got!r}, the update announced "
                                f"{update_info.version!r}; nothing was applied")
        self.last_version = None if got is None else str(got)
        if self._session_version is None:
            self._session_version = tag
        log.info("unisleep weight transfer: staged %d tensors (version %s) over %s in %.3f s",
                 len(self._staged), self.last_version, getattr(report, "path", "?"),
                 time.perf_counter() - t0)
        if update_info.final:
            self._verify_coverage(update_info.partial)
            self._verified = True

    def _verify_coverage(self, partial: bool) -> None:
        expected = self._expected_specs()
        if expected is None:
            log.warning("unisleep weight transfer: no local checkpoint to check coverage against")
            return
        unknown = sorted(n for n in self._staged if n not in expected)
        if unknown:
            raise TransferError(f"update names {len(unknown)} tensor(s) the checkpoint does not "
                                f"have, e.g. {unknown[:3]}; nothing was applied")
        bad = [(n, tuple(t.shape), expected[n]) for n, t in self._staged.items()
               if tuple(t.shape) != tuple(expected[n])]
        if bad:
            n, got, want = bad[0]
            raise TransferError(f"{len(bad)} tensor(s) have the wrong shape, e.g. {n}: {got} "
                                f"instead of {want}; nothing was applied")
        missing = sorted(n for n in expected if n not in self._staged)
        if missing and not partial:
            raise TransferError(
                f"incomplete update: {len(missing)} of {len(expected)} checkpoint tensors "
                f"missing (e.g. {missing[:3]}); nothing was applied and the served weights are "
                "unchanged (send every tensor, or mark the update partial=True)")

    def finish_weight_update(self) -> None:
        if not self._verified:
            raise TransferError("finish_weight_update before a final, verified update_weights "
                                "chunk; nothing was applied (send the last chunk with "
                                "final=True, then finish)")
        self._check_weights_awake()  # the engine may have been put to sleep since the start
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        staged, self._staged = self._staged, {}
        self._verified = False
        self._active = False
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                initialize_layerwise_reload(self.model)
                self.model.load_weights(iter(staged.items()))
                finalize_layerwise_reload(self.model, self.model_config)
        except Exception as e:
            log.error("unisleep weight transfer: %s (%s: %s)", RESTART_REQUIRED,
                      type(e).__name__, e)
            raise RuntimeError(f"{RESTART_REQUIRED} ({type(e).__name__}: {e})") from e
        self.applied_versions.append(self.last_version)
        self._floor, self._session_version = self._session_version, None
        log.info("unisleep weight transfer: applied %d tensors (version %s) in %.3f s",
                 len(staged), self.last_version, time.perf_counter() - t0)

    def shutdown(self) -> None:
        group, self.group = self.group, None
        self._staged = {}
        self._active = self._verified = False
        if group is not None:
            try:
                group.close()
            except Exception:  # pragma: no cover
                pass


__all__ = ["UnisleepWeightTransferEngine", "UnisleepInitInfo", "UnisleepUpdateInfo",
           "checkpoint_specs", "checkpoint_nbytes", "STAGING", "RESTART_REQUIRED", "ABORTED"]
