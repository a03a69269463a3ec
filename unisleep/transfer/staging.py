"""The receiver's buckets of one update as they arrive (:class:`RecvState`): checked against the
manifest, then applied at once into the live weights (streaming, the default: no bucket is kept
once applied) or, when the receiver is ``staged``, held until the whole update is good."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import TransferError
from . import records as R
from .manifest import BucketPlan, TensorSpec, check_bucket
from .names import short_names


class VerifyError(TransferError):
    """The update's bytes fail the manifest (missing, corrupt, out of place), or the sender
    aborted it and said so: refused, and the IPC socket is still in step."""


class RecvState:
    """Buckets of one update as they arrive: verified, then applied at once (or staged);
    ``rx`` is the :class:`~unisleep.transfer.receiver.WeightReceiver` receiving them.

    ``touched`` counts the buckets whose apply began (an apply that raises may have written part
    of its bucket), ``touched_names`` their tensors; ``applied`` the buckets applied whole.  A
    streaming update keeps no reference to a bucket once it is applied (``got`` records only
    which arrived)."""

    def __init__(self, rx: Any, seq: int, specs: Sequence[TensorSpec], plans: list[BucketPlan], verify: bool,
                 seal=None, epoch: int = 0, cipher=None):
        self.rx, self.seq, self.specs, self.plans, self.verify = rx, seq, specs, plans, verify
        self.seal, self.epoch, self.cipher = seal, epoch, cipher
        self.got: dict[int, Any] = {}
        self.rejected: set[int] = set()
        self.corrupt: list[str] = []
        self.problems: list[str] = []
        self.aborted = False
        self.applied = 0
        self.touched = 0
        self.touched_names: list[str] = []
        self.apply_failed: list[int] = []  # the bucket whose apply raised
        self._tmap: Optional[dict] = None

    def take(self, k: int, buf, authentic: Optional[bool] = None) -> None:
        """Bucket ``k`` arrived in ``buf``; ``authentic``: the verdict of its AES-GCM tag when it
        came encrypted (its tensors are then not digested again)."""
        if not 0 <= k < len(self.plans):
            self.problems.append(f"bucket {k} is not in the manifest ({len(self.plans)} buckets)")
            return
        plan = self.plans[k]
        if k in self.got or k in self.rejected:
            self.problems.append(f"bucket {k} arrived twice")
            return
        if buf.numel() != plan.total_bytes:
            self.problems.append(f"bucket {k} has {buf.numel()} bytes, the manifest says {plan.total_bytes}")
            self.corrupt += [self.specs[s.index].name for s in plan.slots]
            self.rejected.add(k)
            return
        if authentic is False:
            self.problems.append(f"bucket {k} fails authentication (its AES-GCM tag): altered or forged on the way")
            self.corrupt += [self.specs[s.index].name for s in plan.slots]
            self.rejected.add(k)
            return
        if self.verify or authentic:
            problem, bad = check_bucket(buf, plan, self.seq, self.seal if self.verify else None)
            if problem:
                self.problems.append(problem)
            if bad:
                self.corrupt += [self.specs[plan.slots[i].index].name for i in bad]
                self.rejected.add(k)
                return
        self.got[k] = buf if self.rx.staged else None
        if not self.rx.staged and not self.corrupt and not self.problems:
            self._apply(plan, buf)

    def finish(self, version) -> None:
        """Raise :class:`VerifyError` unless every bucket arrived and passed (the receiver adds
        what became of the weights: untouched, rolled back or torn)."""
        if self.aborted:
            try:
                why = self.rx.group.take(f"u{self.seq}/abort", R.ABORT, seq=self.seq, epoch=self.epoch, timeout_s=5.0,
                                         peer="the sender (rank 0)", watch=[0], what="the sender's reason")["why"]
            except TransferError:
                why = "no reason given"
            raise VerifyError(f"the sender aborted update {self.seq} (version {version!r}): {why}")
        missing_b = [p for p in self.plans if p.index not in self.got and p.index not in self.rejected]
        missing = [self.specs[s.index].name for p in missing_b for s in p.slots]
        if missing or self.corrupt or self.problems:
            parts = []
            if missing:
                parts.append(f"incomplete: {len(missing)} tensor(s) never arrived (buckets "
                             f"{short_names([str(p.index) for p in missing_b])}): {short_names(missing)}")
            if self.corrupt:
                parts.append(f"corrupt: {len(self.corrupt)} tensor(s) fail the manifest's keyed digest: {short_names(self.corrupt)}")
            if self.problems:
                parts.append("; ".join(self.problems[:4]))
            raise VerifyError(f"update {self.seq} (version {version!r}) refused: " + "; ".join(parts))

    def _views(self, plan: BucketPlan, buf) -> list:
        out = []
        for s in plan.slots:
            spec = self.specs[s.index]
            v = buf[s.offset: s.offset + s.nbytes].view(spec.torch_dtype()).view(spec.shape)
            out.append((spec.name, v))
        return out

    def _apply(self, plan: BucketPlan, buf) -> None:
        import torch

        pairs = self._views(plan, buf)
        self.touched += 1
        self.touched_names += [name for name, _ in pairs]
        try:
            if self.rx.apply is not None:
                self.rx.apply(pairs)
            else:
                if self._tmap is None:
                    self._tmap = self.rx._target_map()
                tmap = self._tmap
                with torch.no_grad():
                    for name, v in pairs:
                        tmap[name].copy_(v)
        except BaseException:
            self.apply_failed.append(plan.index)
            raise
        self.applied += 1

    def commit(self) -> None:
        if not self.rx.staged:
            return
        for plan in self.plans:
            self._apply(plan, self.got[plan.index])
        self.got.clear()
