"""The receiving side of unisleep's vLLM weight transfer, shared by the weight-transfer engine
(:mod:`.transfer_engine`, vLLM >= 0.25) and the worker extension (:mod:`.extension`,
every vLLM from 0.24, called through ``collective_rpc``).

:class:`ReceiverCore` runs one update session: ``start_weight_update`` (weights awake? device
staging fits?), ``update_weights`` x N (each chunk received over a
:class:`~unisleep.transfer.TransferGroup`, verified against the sender's manifest, checked against
the checkpoint the model was loaded from, and loaded into the model bucket by bucket inside one
vLLM layerwise reload — or, with ``staging`` "host"/"device", held whole), ``finish_weight_update``
(coverage checked, the reload finished, or the staged update applied).  A failure part-way puts
back every layer the update did not complete and marks the receiver ``torn`` when some layer
already holds new weights (the error's ``outcome`` says which).

Its host object provides ``model``, ``model_config``, ``parallel_config`` and ``device`` (vLLM's
engine base class sets them; :class:`WorkerReceiver` takes them from a worker), and
``parse_update_info`` (dict -> typed update info).  vLLM is imported only in
``finish_weight_update``.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError, UnisleepError


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")

#: the answer of the unisleep transfer engine to ``update_weights({"abort": true})``
ABORTED = "unisleep weight update aborted on request"

log = logging.getLogger("unisleep.vllm_worker.transfer_engine")

RESTART_REQUIRED = ("the vLLM engine must be restarted: applying the verified update failed "
                    "after the model entered layerwise-reload state")


@dataclass
class TransferInit:
    """init_info of an update group (see :mod:`.transfer_engine` for the fields)."""
    rendezvous: str = ""
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = 300.0
    group_name: str = "vllm"
    secret_file: str = ""    # path of the group secret (mode 0600), never the secret itself
    insecure: bool = False   # a non-loopback group without a secret (warns)
    staging: str = "none"    # "none" (streaming), or whole-update staging: "host" or "device" (fit-checked)


@dataclass
class TransferUpdate:
    """update_info of one chunk."""
    version: Optional[str] = None   # expected version of this chunk (checked against the sender)
    final: bool = True              # last chunk: check coverage now
    partial: bool = False           # allow an update that covers only some tensors
    abort: bool = False             # drop the staged tensors and close the session; receives nothing
    allow_equal_versions: bool = False  # accept a version equal to the one applied last


INIT_FIELDS = tuple(f.name for f in fields(TransferInit))
UPDATE_FIELDS = tuple(f.name for f in fields(TransferUpdate))


def parse_fields(cls, data: Any, what: str):
    """``cls(**data)`` with a clear error for unknown keys or a non-dict."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{what} must be a dict, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidArgumentError(f"{what} has unknown keys {unknown}; known: {sorted(known)}")
    return cls(**data)


#: "none": each verified bucket goes into the model at once; "host"/"device": the whole update is
#: held there until complete (opt-ins)
STAGING = ("none", "host", "device")
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



class ReceiverCore:
    """One update session at a time; see the module docstring.  Call :meth:`_init_core` from
    the host's ``__init__``."""

    def _init_core(self) -> None:
        self.group = None
        self._staged: dict[str, torch.Tensor] = {}
        self._verified = False
        self._active = False
        self.last_version: Optional[str] = None
        self._session_version: Any = None
        self._floor: Any = None  # transfer version of the update applied last (in this group)
        self.applied_versions: list[Optional[str]] = []
        self.staging = "none"  # "none": apply each verified bucket; "host"/"device": stage (init_info)
        self._seen: dict[str, tuple] = {}  # name -> shape of every tensor received this session
        self._reloading = False  # the model is in vLLM's layerwise-reload state (streaming session)
        self._refusal: Optional[BaseException] = None  # a bucket refused before it was applied
        #: transfer name -> (shape, dtype name) the caller announced (OpenRLHF's update_weight)
        self.announced: dict[str, tuple] = {}
        #: the dtype every tensor of this session must have (the model's, where the caller
        #: checks that, as OpenRLHF does), or None
        self.required_dtype: Optional[str] = None
        #: a streaming session that failed after part of it was applied: its description
        self.torn: Optional[str] = None
        # checkpoint specs per update target (the model's, the draft's): keyed by checkpoint path
        self._expected: dict[str, dict[str, tuple[int, ...]]] = {}
        # the same, keyed by what vLLM's load_weights makes of each name (_weight_key)
        self._expected_keys: dict[str, dict[Any, tuple[int, ...]]] = {}
        # transfer name -> model name, for a sender that does not know the names (OpenRLHF's
        # broadcast carries only the tensor; the name comes with the worker call)
        self.rename: dict[str, str] = {}
        self._rx = None  # the WeightReceiver of the current group
        self.fixed_rank: Optional[int] = None  # a framework's own rank layout (OpenRLHF's)

    # ---- helpers --------------------------------------------------------------------
    def _worker_rank(self, info) -> int:
        if self.fixed_rank is not None:
            return self.fixed_rank
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

    def _weight_key(self, name: str) -> Any:
        """What vLLM's ``load_weights`` makes of a weight name: the update target's
        ``hf_to_vllm_mapper`` (renamed, re-prefixed, stacked with its shard), or the name itself
        when the model has none.  None: vLLM drops that name."""
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        fn = getattr(mapper, "_map_name_with_shard", None) or getattr(mapper, "_map_name", None)
        if fn is None:
            return name
        try:
            return fn(name)
        except Exception:  # a mapper this code does not know: the name as it is
            return name

    def _expected_shape(self, name: str, expected: dict) -> Optional[tuple[int, ...]]:
        """The checkpoint's shape for ``name``: its own, that of the checkpoint tensor vLLM
        loads into the same place (OPT: ``decoder.x`` as ``model.decoder.x``), or — for a fused
        parameter's name (``qkv_proj``, ``gate_up_proj``: the model's ``packed_modules_mapping``),
        which vLLM's ``load_weights`` hands whole to the fused parameter's weight loader — the
        checkpoint's parts stacked along the first dimension; None: none."""
        if name in expected:
            return tuple(expected[name])
        fused = self._fused_shape(name, expected)
        if fused is not None:
            return fused
        key = self._weight_key(name)
        if key is None:
            return None
        path = str(getattr(self.model_config, "model", "") or "")
        keys = self._expected_keys.get(path)
        if keys is None:
            keys = self._expected_keys[path] = {}
            for n, shape in expected.items():
                k = self._weight_key(n)
                if k is not None:
                    keys.setdefault(k, tuple(shape))
        return keys.get(key)

    def _fused_parts(self, names) -> list:
        """The part names (``...q_proj.weight``...) of the fused names among ``names``."""
        packed = dict(getattr(self.model, "packed_modules_mapping", None) or {})
        out = []
        for name in names:
            for fused, parts in packed.items():
                token = f".{fused}."
                if token in name:
                    out += [name.replace(token, f".{part}.", 1) for part in parts]
        return out

    def _fused_shape(self, name: str, expected: dict) -> Optional[tuple[int, ...]]:
        packed = getattr(self.model, "packed_modules_mapping", None) or {}
        for fused, parts in dict(packed).items():
            token = f".{fused}."
            if token not in name or not parts:
                continue
            shapes = [self._expected_shape(name.replace(token, f".{part}.", 1), expected) for part in parts]
            if all(shapes) and all(len(sh) >= 1 and sh[1:] == shapes[0][1:] for sh in shapes):
                return (sum(sh[0] for sh in shapes),) + tuple(shapes[0][1:])
        return None

    def _check_weights_awake(self) -> None:
        """Fail closed: with sleep mode on, refuse unless the allocator holding the weights says
        they are awake (read from the engine's own model config: a draft's says nothing)."""
        mc = getattr(self, "_default_model_config", self.model_config)
        if not getattr(mc, "enable_sleep_mode", False):
            return  # vLLM keeps no sleep pools: the weights are never released
        from .allocator import vllm_weights_asleep

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

    # ---- the session --------------------------------------------------------
    def init_transfer_engine(self, init_info) -> None:
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
        if self._reloading:  # a session left open: put the model back first
            self.abort_session()
        self._staged = {}
        self._seen = {}
        self._refusal = None
        self._verified = False
        self._active = True
        self._session_version = None  # version of this session's chunks (set by the first)

    def _weight_receiver(self):
        """The group's one receiver, kept across chunks and updates: it remembers the sender's
        manifests (a sender reuses them when the specs repeat) and its IPC connection."""
        from ..transfer import WeightReceiver

        if self._rx is None or self._rx.group is not self.group:
            self._rx = WeightReceiver(self.group, apply=self._take, staged=False)
        return self._rx

    def refuse_next_update(self) -> None:
        """Read the next update's header and refuse it (the sender hears it at once and sends
        nothing), for a caller that refused the update before receiving it."""
        rx = self._weight_receiver()
        saved = rx.guard
        rx.guard = lambda: False  # the receiver answers "asleep" before anything moves
        try:
            rx.receive()
        except InvalidTransitionError:
            pass
        finally:
            rx.guard = saved

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class would call torch.accelerator.synchronize(), which raises on host
        typed = self.parse_update_info(update_info)
        if typed.abort:
            tail = self._end_failed_session()
            # vLLM has no abort route; an error here makes the worker close the session
            raise RuntimeError(f"{ABORTED}; {tail}")
        try:
            self.receive_weights(typed)
        except BaseException as e:
            tail = self._end_failed_session()  # the worker aborts the session
            if isinstance(e, UnisleepError):
                err = type(e)(f"{e}; {tail}")
                err.outcome = "torn" if self.torn else "untouched"
                raise err from e
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

    def _refuse_bucket(self, pairs: list) -> Optional[BaseException]:
        """Why a verified bucket must not go into the model (announced shape or dtype, a name
        or shape the checkpoint does not have, a tensor twice), before any of it is applied."""
        expected = self._expected_specs()
        for name, t in pairs:
            if name in self._seen:
                return InvalidArgumentError(f"tensor {name!r} twice in one update; nothing more was applied")
            if expected is not None:
                want = self._expected_shape(name, expected)
                if want is None:
                    return TransferError(f"update names 1 tensor(s) the checkpoint does not have (nor "
                                         f"vLLM's load_weights maps to one it has), e.g. [{name!r}]; "
                                         "nothing more was applied")
                if tuple(t.shape) != want:
                    return TransferError(f"1 tensor(s) have the wrong shape, e.g. {name}: {tuple(t.shape)} "
                                         f"instead of {want}; nothing more was applied")
        return None

    def _take(self, named: list) -> None:
        """One verified bucket (views of transfer memory, valid during the call): checked, then
        loaded into the model at once (``staging="none"``) or kept whole (``"host"``: pageable
        host memory, not the caching pinned allocator; ``"device"``: a device copy).  A bucket
        refused by the checks is not applied and the refusal is raised once the transfer ended."""
        if self._refusal is not None:
            return
        pairs = []
        for tname, t in named:
            name = self.rename.get(tname, tname)
            want = self.announced.get(tname)  # (name, shape, dtype name, refusal or None)
            if want is not None and want[0] != name:
                want = None
            if want is not None and want[3]:
                self._refusal = InvalidArgumentError(f"update_weight({name!r}): {want[3]}; nothing more was applied")
                return
            if want is not None and (tuple(t.shape) != tuple(want[1]) or dtype_name(t.dtype) != want[2]):
                self._refusal = InvalidArgumentError(
                    f"update_weight({name!r}) announced {tuple(want[1])} {want[2]}, the trainer sent "
                    f"{tuple(t.shape)} {dtype_name(t.dtype)}; nothing more was applied")
                return
            if self.required_dtype is not None and dtype_name(t.dtype) != self.required_dtype:
                self._refusal = InvalidArgumentError(
                    f"{name!r}: mismatch dtype: src {dtype_name(t.dtype)}, dst {self.required_dtype} (the "
                    "engine's model dtype); nothing more was applied")
                return
            pairs.append((name, t.detach()))
        self._refusal = self._refuse_bucket(pairs)
        if self._refusal is not None:
            return
        for name, t in pairs:
            self._seen[name] = tuple(t.shape)
        if self.staging == "none":
            self._load(pairs)
        else:
            for name, t in pairs:
                self._staged[name] = t.clone() if self.staging == "device" else t.to("cpu", copy=True)
            if self.device.type != "cpu":  # the views of transfer memory are reused once this returns
                torch.accelerator.synchronize()

    def _load(self, pairs: list) -> None:
        """Load one bucket into the model inside this session's layerwise reload (begun at the
        session's first bucket, finished in :meth:`finish_weight_update`).  vLLM buffers a
        layer's tensors until the layer is complete: the bucket goes in as views of transfer
        memory, and what vLLM still buffers once ``load_weights`` returns (the layers this bucket
        did not complete) is copied out before that memory is handed back — a layer completed
        within the bucket costs no copy."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with torch.no_grad(), self._apply_context():
            if not self._reloading:
                initialize_layerwise_reload(self.model)
                self._reloading = True
            if not self._buffers_readable():
                self.model.load_weights(iter([(name, t.clone()) for name, t in pairs]))
                return
            self.model.load_weights(iter(pairs))
            self._copy_buffered({t.untyped_storage().data_ptr() for _, t in pairs})

    def _buffers_readable(self) -> bool:
        """Whether this vLLM's layerwise reload keeps its buffered tensors where
        :meth:`_copy_buffered` finds them (``LayerReloadingInfo.loaded_weights``: (name,
        ``inspect.BoundArguments``) pairs — vLLM 0.24 to 0.33); otherwise each tensor is copied
        before it goes in."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        except ImportError:
            return False
        info = get_layerwise_info(self.model)
        return isinstance(getattr(info, "loaded_weights", None), list)

    def _copy_buffered(self, storages: set) -> None:
        """Replace every tensor vLLM's layerwise reload still buffers that lives in one of
        ``storages`` (transfer memory) by a copy of it."""
        import inspect

        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        for layer in self.model.modules():
            for _, bound in get_layerwise_info(layer).loaded_weights:
                if not isinstance(bound, inspect.BoundArguments):
                    continue
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                        bound.arguments[key] = value.clone()

    def receive_weights(self, update_info) -> None:
        if not self._active:
            raise RuntimeError("update_weights without start_weight_update")
        t0 = time.perf_counter()
        # versions increase from one update to the next; the chunks of one update share theirs
        # staged=False: each verified bucket goes straight to this engine's own staging (host by
        # default), so the transfer holds two bucket buffers on the device, not a second copy
        # of the update; atomicity comes from that staging (the model is touched in finish)
        rx = self._weight_receiver()
        if self._session_version is None:
            rx.version, rx.allow_equal_versions = self._floor, bool(update_info.allow_equal_versions)
        else:
            rx.version, rx.allow_equal_versions = self._session_version, True
        report = rx.receive()
        if self._refusal is not None:
            raise self._refusal
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
        log.info("unisleep weight transfer: received %d tensors (version %s, staging %s) over %s in %.3f s",
                 len(self._seen), self.last_version, self.staging, getattr(report, "path", "?"),
                 time.perf_counter() - t0)
        if update_info.final:
            self._verify_coverage(update_info.partial)
            self._verified = True

    def _verify_coverage(self, partial: bool) -> None:
        expected = self._expected_specs()
        if expected is None:
            log.warning("unisleep weight transfer: no local checkpoint to check coverage against")
            return
        # names and shapes were checked bucket by bucket, before each was applied
        missing = [n for n in expected if n not in self._seen]
        if missing:  # a tensor may have come under another name that vLLM loads into the same place
            got = {self._weight_key(n) for n in self._seen}
            missing = [n for n in missing if self._weight_key(n) not in got]
        if missing:  # ... or inside a fused parameter's tensor (qkv_proj holds q_proj, k_proj, v_proj)
            covered = set(self._fused_parts(self._seen))
            missing = [n for n in missing if n not in covered]
        missing.sort()
        if missing and not partial:
            raise TransferError(
                f"incomplete update: {len(missing)} of {len(expected)} checkpoint tensors "
                f"missing (e.g. {missing[:3]}) (send every tensor, or mark the update partial=True)")

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
            with torch.no_grad(), self._apply_context():
                if self.staging != "none":
                    initialize_layerwise_reload(self.model)
                    self.model.load_weights(iter(staged.items()))
                    staged.clear()
                    finalize_layerwise_reload(self.model, self.model_config)
                elif self._reloading:
                    self._reloading = False
                    finalize_layerwise_reload(self.model, self.model_config)
        except Exception as e:
            log.error("unisleep weight transfer: %s (%s: %s)", RESTART_REQUIRED,
                      type(e).__name__, e)
            raise RuntimeError(f"{RESTART_REQUIRED} ({type(e).__name__}: {e})") from e
        self.torn = None
        self.applied_versions.append(self.last_version)
        self._floor, self._session_version = self._session_version, None
        log.info("unisleep weight transfer: applied %d tensors (version %s) in %.3f s (finish)",
                 len(self._seen), self.last_version, time.perf_counter() - t0)

    def _restore_model(self) -> bool:
        """End this session's layerwise reload after a failure: the layers that were completed
        keep the new weights, every other layer gets its served tensors back (a partly loaded
        layer's buffered tensors are dropped first).  True when some layer holds new weights."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self._reloading = False
        written = False
        with torch.no_grad(), self._apply_context():
            for layer in self.model.modules():
                info = get_layerwise_info(layer)
                own = any(True for _ in layer.parameters(recurse=False))
                if not info.can_load():
                    written = written or own  # completed in this session: new weights
                elif info.load_numel > 0:
                    info.loaded_weights = []
                    info.load_numel = 0
            finalize_layerwise_reload(self.model, self.model_config)
        return written

    def _end_failed_session(self) -> str:
        """Close a failed session; what it says of the served weights."""
        self._staged = {}
        self._verified = self._active = False
        self._session_version = None
        if not self._reloading:
            return "nothing was applied and the served weights are unchanged"
        try:
            written = self._restore_model()
        except Exception as e:  # noqa: BLE001
            log.error("unisleep weight transfer: %s (%s: %s)", RESTART_REQUIRED, type(e).__name__, e)
            self.torn = f"the model could not be put back after a failed update ({type(e).__name__}: {e})"
            return f"{RESTART_REQUIRED} ({type(e).__name__}: {e})"
        if not written:
            return "nothing was applied and the served weights are unchanged"
        self.torn = (f"an update failed after {len(self._seen)} tensor(s) were received; the layers "
                     "completed before the failure hold the new weights, the others the old ones")
        log.warning("unisleep weight transfer: the weights are torn: %s", self.torn)
        return (f"the weights are torn: {self.torn}; send the whole update again (a complete update "
                "repairs them)")

    def abort_session(self) -> bool:
        """Close the open session: drop what it staged, or end its layerwise reload (the layers
        it did not complete keep their weights; see :attr:`torn`).  True when one was open."""
        was = bool(self._active or self._staged or self._reloading)
        self._end_failed_session()
        return was

    def _apply_context(self):
        """Context of the apply step (vLLM's worker already sets the config for its engine)."""
        import contextlib

        return contextlib.nullcontext()

    def shutdown(self) -> None:
        rx, self._rx = self._rx, None
        if rx is not None:
            try:
                rx.close()
            except Exception:  # pragma: no cover
                pass
        group, self.group = self.group, None
        if self._reloading:
            self._end_failed_session()
        self._staged = {}
        self._active = self._verified = False
        if group is not None:
            try:
                group.close()
            except Exception:  # pragma: no cover
                pass



class WorkerReceiver(ReceiverCore):
    """A :class:`ReceiverCore` over a vLLM worker's model (the worker extension's)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self._init_core()

    @property
    def model(self):
        runner = self.worker.model_runner
        get = getattr(runner, "get_model", None)
        return get() if callable(get) else runner.model

    @property
    def model_config(self):
        return self.worker.vllm_config.model_config

    @property
    def parallel_config(self):
        return self.worker.vllm_config.parallel_config

    @property
    def device(self) -> torch.device:
        dev = getattr(self.worker, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def _apply_context(self):
        """The worker's vLLM config and device, as vLLM's own worker sets them around its
        weight-update calls."""
        import contextlib

        stack = contextlib.ExitStack()
        try:
            from vllm.config import set_current_vllm_config

            stack.enter_context(set_current_vllm_config(self.worker.vllm_config))
        except ImportError:  # pragma: no cover - every vLLM unisleep supports has it
            pass
        stack.enter_context(torch.device(self.device))
        return stack

    def parse_init_info(self, data) -> TransferInit:
        return parse_fields(TransferInit, data, "init_info")

    def parse_update_info(self, data) -> TransferUpdate:
        return parse_fields(TransferUpdate, data, "update_info")


__all__ = ["ReceiverCore", "WorkerReceiver", "TransferInit", "TransferUpdate", "INIT_FIELDS",
           "UPDATE_FIELDS", "checkpoint_specs", "checkpoint_nbytes", "STAGING", "RESTART_REQUIRED",
           "ABORTED", "parse_fields"]
