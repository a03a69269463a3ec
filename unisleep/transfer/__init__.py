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

Paths: ``collective`` (the group's process-group backend: gloo on host, the vendor collective on
accelerators) or ``ipc`` (colocated: bucket memory shared through a file descriptor passed over a
Unix socket; the vendor's ``ipc`` module makes the shareable memory).

Modules: ``group`` (the private group), ``rendezvous`` (its address and listening socket), ``peers``
(who the members are), ``data_channel`` (the backend per epoch), ``liveness`` (heartbeats),
``store`` (the group's store: only members use it, bounded; split into ``store_wire``,
``store_table``, ``store_server``, ``store_client``), ``fd_limit`` (running out of descriptors),
``netinfo`` (who is at the other end of a local TCP connection), ``records`` (the authenticated
control records), ``secret`` (the group secret), ``manifest`` (specs, buckets, digests),
``sender`` (``WeightSender``), ``receiver`` (``WeightReceiver``), ``receive_paths`` (its receiving
loops), ``staging`` (the receiver's buckets of one update), ``rollback`` (a failure part-way), ``channels`` (the IPC messages and what
the send channels share), ``send_channels`` (collective and Unix-stream), ``ipc_send`` (IPC),
``names`` (``(name, tensor)`` pairs), ``report`` (``TransferReport``).
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
