"""One update of :class:`~unisleep.transfer.sender.WeightSender` once its header is made: the
header posted, every receiver's acknowledgement (on its IPC connection or in the store), the
buckets packed (hashed or encrypted in the same pass) and streamed double buffered, then every
receiver's commit — and the calling off of an update before any byte moved.  The protocol half of
``WeightSender``, as a base class."""

from __future__ import annotations

import time
from typing import Iterator, Optional

from ..errors import InvalidArgumentError, InvalidTransitionError, TransferError, UnisleepError, VersionError
from .channels import ipc_text, named_error, pack_tensor
from .cipher import BucketCipher
from .ipc_send import IpcSendChannel
from . import records as R
from .manifest import BucketPlan, Manifest, UpdateSeal, check_tensor, dtype_name, write_trailer
from .report import TransferReport
from .send_channels import CollectiveSendChannel, SocketSendChannel


class _SendUpdate:
    """``WeightSender``'s update protocol and bucket packing (see the module)."""

    def _send_update(self, g, t0, version, manifest, items, plans, seq, epoch, path, via, cipher, reuse, sock,
                     digests, header) -> TransferReport:
        """The update once its header is made: post it, stream the buckets, wait for every commit."""
        control = header["control"]
        intrusions0 = len(g.intrusions)
        g.put("hdr", header, seq, epoch)
        # the update's keys: made while the last update committed, else now, while the receivers
        # read the header (not after "go")
        ahead, self._seal_ahead = self._seal_ahead, None
        seal = None
        if digests:
            seal = ahead[2] if ahead is not None and ahead[:2] == (seq, epoch) else UpdateSeal.prepared(g, seq, epoch, plans)
        crypt = BucketCipher.of(g, seq, epoch) if cipher != "none" else None
        # ---- colocated: the first bucket is packed (and hashed) while the receivers read the
        # header and answer; its bytes stay in this process's own buffer until "go"
        chan = first = packing = None
        if path == "ipc" and plans and not self._ipc.busy[0]:
            chan = IpcSendChannel(self, seq)
            try:
                first = self._pack(plans[0], chan, items, manifest.specs, seq, seal)
            except Exception as e:  # the generator, a spec mismatch: said once the receivers answered
                packing = e
            except BaseException as e:
                self._call_off(seq, epoch, f"{type(e).__name__}: {e}", control)
                raise
        # the last update's records are dropped while the receivers answer (after the first
        # bucket's packing is queued: nothing waits on them) — unless every answer of it travelled
        # on the IPC connections (it left no record in the store)
        if seq and self._no_records != seq - 1:
            for k in ("go", "abort", *(f"ack/{r}" for r in g.receivers), *(f"done/{r}" for r in g.receivers)):
                g.drop(f"u{seq - 1}/{k}")
        # ---- acknowledgements: nothing moves before every receiver said yes
        refusals, connect = [], []
        by_ipc: list[int] = []  # receivers that acknowledged on their IPC connection (go and done go there too)
        try:
            g.check_alive(g.receivers)  # a dead receiver: say so now, not after a timeout
            if via == "backend":
                g.process_group()  # a new epoch connects here; the receivers follow when they read the header
            for r in g.receivers:
                what = f"receiver rank {r} to accept update {seq} (version {version!r}); is receive() running?"
                ack = self._ipc_record(r, "ack", seq, what, f"u{seq}/ack/{r}") if control == "ipc" else None
                if ack is not None:
                    by_ipc.append(r)
                else:
                    ack = g.take(f"u{seq}/ack/{r}", R.ACK, seq=seq, epoch=epoch, peer=f"receiver rank {r}", watch=[r],
                                 what=what)
                if not ack["ok"]:
                    refusals.append((r, ack))
                elif ack["connected"]:
                    connect.append(r)
        except BaseException as e:
            self._call_off(seq, epoch, f"{type(e).__name__}: {e}", control)
            raise
        if refusals:
            self._call_off(seq, epoch, "a receiver refused", control)
            r, ack = refusals[0]
            if any(a["kind"] == "metadata" for _, a in refusals):
                self._last_meta_id = None
            cls = {"asleep": InvalidTransitionError, "version": VersionError}.get(ack["kind"], TransferError)
            raise cls(f"receiver rank {r} refused update {seq} (version {version!r}); nothing was sent: {ack['msg']}")
        if packing is not None:  # every receiver that read the header hears why, as "called off"
            self._call_off(seq, epoch, f"{type(packing).__name__}: {packing}", control)
            if isinstance(packing, UnisleepError):
                raise packing
            raise TransferError(f"update {seq} (version {version!r}) aborted on the sender: "
                                f"{type(packing).__name__}: {packing}") from packing
        t_ack = time.perf_counter()
        if len(by_ipc) < len(g.receivers):
            g.put(f"u{seq}/go", {"go": True, "why": ""}, seq, epoch)
        # ---- stream the buckets
        live = None  # the channel, once every receiver is connected to it
        try:
            for r in by_ipc:
                self._ipc.conns[r].send("go", u=seq)
            if sock:
                self._ipc.accept(connect)
                missing = sorted(set(g.receivers) - set(self._ipc.conns))
                if missing:  # a receiver that kept a connection this side has closed: it connects next time
                    raise TransferError(f"receivers {missing} answered without connecting to the IPC socket, whose "
                                        "connection to them this side had closed")
            live = chan or (IpcSendChannel(self, seq) if path == "ipc" else SocketSendChannel(self, seq)
                            if via == "socket" else CollectiveSendChannel(self, seq, crypt))
            self._stream(items, manifest, plans, seq, live, seal, first)
        except Exception as e:  # the generator, a spec mismatch, the transport...
            ended = False
            try:
                g.put(f"u{seq}/abort", {"why": f"{type(e).__name__}: {e}"[:4000]}, seq, epoch)
                if live is not None:
                    live.end(abort=True)
                    ended = True
            except Exception:
                pass
            if sock and not ended:
                self._drop_ipc()  # the socket is out of step; an ended one stays (the receivers read 'end')
            else:
                g.channel_broke(f"update {seq} broke off")
            dead = self._dead_receivers()
            if isinstance(e, UnisleepError) and not dead:
                raise
            if dead:
                g.broken = dead[0]
                raise TransferError(f"update {seq} (version {version!r}) broke off: {'; '.join(dead)}; recreate the "
                                    f"group ({type(e).__name__}: {str(e)[:300]})") from e
            raise TransferError(f"update {seq} (version {version!r}) aborted on the sender: {type(e).__name__}: {e}") from e
        finally:
            if seal is not None:
                seal.release()
        t_sent = time.perf_counter()
        # ---- every receiver verified and committed?  Meanwhile the next update's keys are made
        # (derived from the group secret, the epoch and the update number: nothing new is learnt)
        if digests:
            self._seal_ahead = (seq + 1, epoch, UpdateSeal.prepared(g, seq + 1, epoch, plans))
        errors, done_by_ipc = [], 0
        try:
            for r in g.receivers:
                what = f"receiver rank {r} to verify and commit version {version!r}"
                done = self._ipc_record(r, "done", seq, what, f"u{seq}/done/{r}") if r in by_ipc else None
                if done is not None:
                    done_by_ipc += 1
                else:
                    done = g.take(f"u{seq}/done/{r}", R.DONE, seq=seq, epoch=epoch, peer=f"receiver rank {r}",
                                  watch=[r], what=what)
                if not done["ok"]:
                    errors.append(f"rank {r}: {done['msg']}")
        except BaseException:
            if via == "backend":
                g.channel_broke(f"update {seq}: no answer")
            raise
        if errors:
            raise named_error(f"update {seq} (version {version!r}) was rejected; receivers keep their previous version: "
                              + "; ".join(errors))
        prev, self.version = self.version, version
        self._last_meta_id = manifest.meta_id
        if len(by_ipc) == done_by_ipc == len(g.receivers):
            self._no_records = seq
        t_done = time.perf_counter()
        release_s = 0.0
        if not header["keep_buffers"]:  # every receiver has given its mappings back: the memory goes now
            self._release_buffers()
            release_s = time.perf_counter() - t_done
        t1 = time.perf_counter()
        self.last_report = TransferReport(version, prev, path, len(manifest.specs), manifest.nbytes, len(plans), t1 - t0,
                                          metadata_reused=reuse, verified=digests or cipher != "none",
                                          phases={"handshake": t_ack - t0, "stream": t_sent - t_ack,
                                                  "commit_wait": t_done - t_sent, "buffers": self._buffer_s,
                                                  "release": release_s},
                                          intrusions=list(g.intrusions[intrusions0:]))
        return self.last_report

    def _dead_receivers(self) -> list[str]:
        """Why receivers are dead, for a transport failure (a process that exited is seen at
        once; a silent heartbeat after a few seconds)."""
        out: list[str] = []
        for r in self.group.receivers:
            try:
                why = self.group.peer_dead(r)
            except Exception:  # noqa: BLE001
                why = None
            if why:
                out.append(why)
        return out

    def _ipc_record(self, r: int, op: str, seq: int, what: str, key: str) -> Optional[dict]:
        """Receiver ``r``'s ``ack`` or ``done`` of update ``seq`` from its IPC connection, as the
        store's record would say it (an ``error`` there is a ``done`` that failed); None when the
        receiver wrote it to the store (at ``key``) instead."""
        msg = self._ipc.control(r, op, seq, what, key) if self._ipc is not None else None
        if msg is None:
            return None
        ok = msg["op"] == op and msg["ok"]
        return {"ok": ok, "kind": msg["kind"] if msg["op"] == op else "error", "msg": msg["msg"], "connected": False}

    def _call_off(self, seq: int, epoch: int, why: str, control: str) -> None:
        """Before any byte moved: withdraw the header (a late receiver waits for the next one)
        and tell those waiting for ``go`` — in the store, and (``control == "ipc"``) on every IPC
        connection (a receiver that is not waiting there skips it as a word of an earlier update)."""
        g = self.group
        g.drop("hdr")
        if control == "ipc" and self._ipc is not None:
            for r in list(self._ipc.conns):
                conn = self._ipc.conns[r]
                try:
                    conn.send("go", u=seq, ok=False, msg=ipc_text(why))
                except TransferError:
                    self._ipc._forget(r, conn)  # gone: that receiver connects again
        try:
            g.put(f"u{seq}/go", {"go": False, "why": why[:4000]}, seq, epoch)
        except TransferError:
            pass

    def _pack(self, plan: BucketPlan, chan, items: Iterator, specs, seq: int, seal, corrupt: bool = False,
              skip: bool = False):
        """Pack (and, on a device, hash in the same pass; on an encrypting channel, encrypt in
        the same pass and send each piece as soon as it is sealed) the next tensors from
        ``items`` into the channel's buffer for ``plan``; returns the buffer."""
        import torch

        buf = chan.buffer(plan.index % 2, plan.total_bytes)
        # a device bucket is hashed while it is packed (one pass over each tensor)
        hasher = seal.hasher(buf, plan) if seal is not None and plan.slots and buf.device.type != "cpu" else None
        sealer = chan.begin(plan, buf, corrupt) if hasattr(chan, "begin") and not skip else None
        with torch.no_grad():
            for i, s in enumerate(plan.slots):
                spec = specs[s.index]
                try:
                    item = next(items)
                except StopIteration:
                    raise TransferError(f"the tensors ran out at {spec.name!r} (#{s.index}); the specs list {len(specs)}") from None
                if not isinstance(item, tuple) or len(item) != 2:
                    raise InvalidArgumentError(f"item #{s.index} of the tensors is not a (name, tensor) pair: "
                                               f"{str(item)[:80]}")
                name, t = item
                check_tensor(name, t, s.index)
                if name != spec.name or t.shape != spec.shape or dtype_name(t.dtype) != spec.dtype:
                    raise TransferError(f"tensor #{s.index} is {name!r} {tuple(t.shape)} {t.dtype}, "
                                        f"the specs say {spec.name!r} {spec.shape} {spec.dtype}")
                if sealer is not None:
                    sealer.put(s, t)
                elif s.nbytes and not (hasher is not None and hasher.fill(i, t)):
                    pack_tensor(buf, s.offset, s.nbytes, t)
            write_trailer(buf, plan, seq, seal, lanes=hasher.lanes() if hasher is not None else None)
            if sealer is not None:
                sealer.close()
        return buf

    def _stream(self, items: Iterator, manifest: Manifest, plans: list[BucketPlan], seq: int, chan, seal,
                first=None) -> None:
        """Pack and post every bucket; ``first``: the first bucket's buffer, packed already."""
        for plan in plans:
            if first is not None and plan.index == 0:
                buf = first
            else:
                buf = self._pack(plan, chan, items, manifest.specs, seq, seal,
                                 corrupt=plan.index in self._faults["corrupt"], skip=plan.index in self._faults["skip"])
            if plan.index in self._faults["skip"]:
                continue
            chan.post(plan.index % 2, plan, buf, corrupt=plan.index in self._faults["corrupt"])
        chan.end(abort=False)
