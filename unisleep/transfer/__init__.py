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
untouched) and authenticated: control records are fixed-schema JSON with an HMAC-SHA256 tag under
a 256-bit group secret (a loopback group of one user makes its own; across machines give every
member ``UNISLEEP_TRANSFER_SECRET_FILE``; see docs/security.md); nothing received is unpickled.
Bytes move over the platform's collective, or — when both ends share a device — by IPC through a
shared file descriptor, handed only to a process that proved the secret.  Every update is checked
against a manifest (names, shapes, dtypes, keyed digests) before it is applied; a failure leaves
the previous version in place (rolled back, or the weights marked torn, when it failed part-way).

One update, in order (every step can fail cleanly; the receiver keeps its previous version):

1. sender: header on the store — version (increasing), update number, epoch, tensor specs (or
   only their id when they are unchanged: metadata is reused), bucket size, path;
2. receiver: guard check (target memory awake?) and target check (names, shapes, dtypes) —
   then an acknowledgement; a refusal stops the sender before a byte moves;
3. sender: ``go``; buckets stream, double buffered — bucket k+1 is packed while bucket k is in
   flight; each bucket carries the keyed digests of its tensors in a trailer;
4. receiver: each bucket is verified against the manifest (digests, order, completeness) and
   applied at once (``apply`` callback or in-place copy into ``target``) while the next arrives —
   or, with ``staged=True``, held until all of them are good; a failure part-way is rolled back
   from the guard lifecycle's retained backup or marks the weights torn (``rollback``);
5. receiver: a ``done`` acknowledgement (or the error), which ``send`` waits for.

One control plane per path: the header is always in the store; the acknowledgement, ``go``,
``abort`` and ``done`` travel in the store on the collective path over the backend, as sealed
messages on the receiver's IPC connection on the IPC path and the Unix-socket path.

Paths: ``collective`` (the group's process-group backend: gloo on host, the vendor collective on
accelerators) or ``ipc`` (colocated: bucket memory shared through a file descriptor passed over a
Unix socket; the vendor's ``ipc`` module makes the shareable memory).

Modules: ``group`` (the private group: rendezvous, members, control records, liveness), ``store``
(the group's store: only members use it, bounded), ``collective`` (the collective path, both ends:
the data channel of each epoch, the broadcast channel, the receiving loop), ``socket_path`` (the
Unix-stream path, both ends), ``ipc`` (the IPC path, both ends: the IPC socket's messages, the
sender's socket and channel, the receiving loop), ``sender`` (``WeightSender`` and its update's
steps), ``receiver`` (``WeightReceiver``, its update's steps, ``RecvState``), ``rollback`` (a failure
part-way), ``manifest`` (specs, buckets, digests, ``(name, tensor)`` pairs), ``cipher`` (AES-256-GCM
over gloo), ``records`` (the authenticated control records), ``secret`` (the group secret),
``netinfo`` (who is at the other end of a local TCP connection; running out of descriptors),
``waiting`` (saying what a member waits for), ``report`` (``TransferReport``).
"""

from .group import DEFAULT_TIMEOUT_S, TransferGroup
from .manifest import Manifest, TensorSpec
from .receiver import WeightReceiver
from .report import TransferReport
from .secret import new_secret, read_secret_file, write_secret_file
from .sender import PATHS, WeightSender, default_bucket_bytes

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
    "new_secret",
    "read_secret_file",
    "write_secret_file",
]
