"""A sender that damages its own updates, for the tests that show what a receiver does with a bucket
that was altered on its way or never arrived: :class:`FaultySender` overrides the two no-op hooks
:class:`~unisleep.transfer.WeightSender` calls once per bucket (its test seam); the production
channels know nothing of it."""

from __future__ import annotations

from unisleep.transfer import WeightSender
from unisleep.transfer.manifest import TRAILER_HEAD


class FaultySender(WeightSender):
    """``corrupt``: indices of the buckets altered once packed — a byte of the first tensor's keyed
    digest in the bucket's trailer is flipped (the receiver finds that tensor's bytes do not match
    its digest, as if they had changed on the way, and names it; on an encrypting channel the byte
    is ciphertext: the bucket's AES-GCM tag fails and all its tensors are named); ``drop``: indices
    of the buckets that are packed but never sent (the receiver names their tensors as never
    arrived).  Either can be changed between updates."""

    def __init__(self, *args, corrupt=(), drop=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.corrupt, self.drop = set(corrupt), set(drop)

    def _sends_bucket(self, plan) -> bool:
        return plan.index not in self.drop

    def _bucket_packed(self, plan, buf) -> None:
        if plan.index in self.corrupt and plan.slots:
            at = plan.data_bytes + 8 * (TRAILER_HEAD + 2)  # the first tensor's digest, lane a
            buf[at: at + 1].bitwise_not_()
