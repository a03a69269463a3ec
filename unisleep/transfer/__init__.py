"""Weight transfer from a trainer to rollout engines, the same API on every platform.

::

    from unisleep.transfer import TransferGroup, WeightSender, WeightReceiver

    # trainer (rank 0)
    group = TransferGroup.create("tcp://127.0.0.1:29555", rank=0, world_size=2)
    sender = WeightSender(group)                      # bucket size from free memory
    sender.send(model.state_dict(), version=step)     # returns once the engine committed it

    # engine (rank 1)
    group = TransferGroup.create("tcp://127.0.0.1:29555", rank=1, world_size=2)
    receiver = WeightReceiver(group, apply=model.load_weights, guard=lifecycle)
    report = receiver.receive()                       # verified, then applied; report.version

The group is private (its own store and process-group backend; the default process group is
untouched).  Bytes move over the platform's collective, or — when both ends share a device — by
IPC through a shared file descriptor.  Every update is checked against a manifest (names,
shapes, dtypes, checksums) before it is applied; a failure leaves the previous version in place.
"""

from .group import DEFAULT_TIMEOUT_S, TransferGroup
from .manifest import Manifest, TensorSpec
from .weights import PATHS, TransferReport, WeightReceiver, WeightSender, default_bucket_bytes

__all__ = [
    "TransferGroup",
    "WeightSender",
    "WeightReceiver",
    "TransferReport",
    "Manifest",
    "TensorSpec",
    "default_bucket_bytes",
    "PATHS",
    "DEFAULT_TIMEOUT_S",
]
