"""One line when a member of a transfer group has waited a while for another member: what it
waits for, and how much longer it will (the ``timeout_s`` of ``TransferGroup.create``).  Without
it, a rank started alone prints nothing until it gives up."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("unisleep.transfer")

#: seconds of silence before a waiting member says what it waits for (members started together
#: find each other well within this)
NOTICE_AFTER_S = 5.0


class WaitNotice:
    """Call :meth:`tick` in a waiting loop: after NOTICE_AFTER_S it logs ``what`` once (WARNING:
    shown without any logging set-up)."""

    def __init__(self, what: str, timeout_s: float):
        self.what, self.timeout_s = what, timeout_s
        self.t0 = time.monotonic()
        self.said = False

    def tick(self) -> None:
        waited = time.monotonic() - self.t0
        if not self.said and waited >= NOTICE_AFTER_S:
            self.said = True
            log.warning("%s; waited %.0f s so far, gives up after %.0f s (timeout_s of TransferGroup.create)",
                        self.what, waited, self.timeout_s)
