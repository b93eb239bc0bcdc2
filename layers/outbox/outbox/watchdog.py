"""One absolute deadline for a whole network exchange.

A socket timeout bounds each ``recv``, not the call: a receiver that drips
one byte every half second keeps an HTTP read alive for as long as it likes.
The watchdog is one daemon thread for the process (never one per call): at a
registered deadline it shuts the call's socket down, so the blocked read
returns at once and the calling thread is free, instead of staying stuck
and holding a send thread, a socket, and the process's exit.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Watch:
    """One guarded exchange; ``fired`` tells the caller its deadline cut it off."""

    deadline: float
    current_socket: Callable[[], socket.socket | None] = field(repr=False)
    fired: bool = False
    done: bool = False


def _no_socket() -> None:
    return None


class SocketWatchdog:
    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    @contextmanager
    def guard(
        self, seconds: float, current_socket: Callable[[], socket.socket | None]
    ) -> Iterator[Watch]:
        """Shut down ``current_socket()`` if the block is still running after ``seconds``."""
        watch = Watch(time.monotonic() + max(0.0, seconds), current_socket)
        with self._wake:
            # Ended exchanges at the head go now: the thread, not woken for
            # every call, would keep them until the head's deadline.
            while self._heap and self._heap[0][2].done:
                heapq.heappop(self._heap)
            heapq.heappush(self._heap, (watch.deadline, next(self._order), watch))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="socket-watchdog", daemon=True
                )
                self._thread.start()
            if self._heap[0][2] is watch:
                # Woken only when this deadline comes first: the thread already
                # sleeps until an earlier one otherwise, and waking it for
                # every call costs a thread switch a call.
                self._wake.notify()
        try:
            yield watch
        finally:
            # Under the lock: once the block is over, its socket is never touched.
            with self._wake:
                watch.done = True
                watch.current_socket = _no_socket  # the connection is not kept alive by this

    def _run(self) -> None:
        with self._wake:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                deadline, _, watch = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                heapq.heappop(self._heap)
                watch.fired = True
                sock = watch.current_socket()
                if sock is not None:
                    # The plain socket's shutdown, under any TLS layer (the TLS
                    # object stays its owner's to close); OSError: already closed.
                    with contextlib.suppress(OSError):
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)


WATCHDOG = SocketWatchdog()
