"""A background thread that reads a communicator's status words and reports a failed channel once:
so that a server can fail the affected requests instead of serving NaN rows."""

import logging
import threading
from typing import Callable, Optional

from dcp.errors import DcpError

log = logging.getLogger("dcp")


class Watchdog:
    """Calls ``channel_error(c)`` for each of ``channels`` every ``interval_s`` seconds (never
    synchronizing the device) and ``on_error(exc)`` once per failed channel (default: log it)."""

    def __init__(self, channels: int, channel_error: Callable[[int], Optional[DcpError]], interval_s: float,
                 on_error: Optional[Callable[[DcpError], None]]):
        self._stop = threading.Event()
        report = on_error or (lambda e: log.error("DCP all-to-all watchdog: %s", e))

        def watch() -> None:
            reported: set = set()
            while not self._stop.wait(interval_s):
                for c in range(channels):
                    error = None if c in reported or self._stop.is_set() else channel_error(c)
                    if error is not None:
                        reported.add(c)
                        report(error)

        self._thread = threading.Thread(target=watch, name="dcp-a2a-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():  # on_error may stop it from inside
            self._thread.join()
