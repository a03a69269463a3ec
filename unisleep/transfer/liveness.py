"""A transfer group's liveness: each member beats a heartbeat (a counter) into the group's
store; a waiting side notices a dead or frozen peer within :data:`DEAD_AFTER_S` seconds of its
last beat (at once when it is a process of this machine that exited) and names it.  How long a
heartbeat has been silent is the store's answer (its clock, the time of the key's last change),
not this side's memory of when it last looked: a side that was busy elsewhere (a trainer's
generator, a send the kernel's buffers took) and looks again knows at once.  :class:`_Liveness`
is a base class of :class:`~unisleep.transfer.group.TransferGroup` and uses its state."""

from __future__ import annotations

import logging
import threading
from typing import Optional

from ..errors import TransferError
from .peers import _pidns

log = logging.getLogger("unisleep.transfer")

HEARTBEAT_S = 0.5
#: a peer whose heartbeat did not move for this long is dead
DEAD_AFTER_S = 4.0


class _Liveness:
    """The heartbeats and liveness checks of :class:`~unisleep.transfer.group.TransferGroup`."""

    def _start_heartbeat(self) -> None:
        key = f"hb/{self.rank}"
        hb = self._hb_store
        hb.add(key, 1)
        gname = self.group_id.split("/")[0]

        def beat():
            failing = False
            while not self._hb_stop.wait(HEARTBEAT_S):
                try:
                    hb.add(key, 1)
                    if failing:
                        log.warning("transfer group %s rank %d: its heartbeat beats again", gname, self.rank)
                        failing = False
                except Exception as e:  # never silently: said, then retried while the store is there
                    self.heartbeat_error = f"{type(e).__name__}: {e}"
                    if isinstance(e, (ConnectionError, OSError)):
                        log.warning("transfer group %s rank %d: the heartbeat stopped: %s", gname, self.rank, e)
                        self.broken = self.broken or f"rank {self.rank} lost the group's store: {e}"
                        return
                    if not failing:
                        log.warning("transfer group %s rank %d: a heartbeat failed (%s); retrying", gname, self.rank,
                                    self.heartbeat_error)
                        failing = True

        self._hb_thread = threading.Thread(target=beat, daemon=True, name=f"unisleep-transfer-hb-{self.rank}")
        self._hb_thread.start()

    def peer_dead(self, r: int) -> Optional[str]:
        """Why rank ``r`` is dead (None: it seems alive)."""
        p = self.peers[r] if r < len(self.peers) else None
        if p is not None and p.boot == self.peers[self.rank].boot and p.pidns == _pidns() and p.pid > 0:
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state in ("Z", "X"):
                    return f"{p.describe()} has exited"
            except FileNotFoundError:
                return f"{p.describe()} has exited"
            except (OSError, IndexError):
                pass
        try:
            got = self.store.aged(f"hb/{r}", 32)
            if got is not None:
                int(got[1].decode("ascii"))
        except (TransferError, UnicodeDecodeError, ValueError) as e:  # only a member could have written it
            self._intrusion(f"rank {r}'s heartbeat in the store is not a counter: {e}")
            return None
        except Exception as e:
            return f"the group's store is gone (rank 0 may have died): {e}"
        if got is not None and got[0] > DEAD_AFTER_S:
            who = p.describe() if p is not None else f"rank {r}"
            return f"{who} gave no sign of life for {got[0]:.1f} s (dead or frozen)"
        return None

    def check_alive(self, ranks) -> None:
        for r in ranks:
            why = self.peer_dead(r)
            if why:
                self.broken = why
                raise TransferError(f"{why}; recreate the group")

    def check_usable(self) -> None:
        if self.closed:
            raise TransferError("this transfer group is closed; create a new one")
        if self.broken:
            raise TransferError(f"this transfer group is broken ({self.broken}); recreate the group on every member")
