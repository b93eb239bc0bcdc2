"""The send threads: the machinery under the sender's policy (``outbox.sender``).

A process keeps one set of daemon threads per size, reused batch after batch
(a warm Lambda environment or ``outbox worker`` does not start new threads
for every hand-off). A batch runs copies of one task on them and waits on a
``Countdown``. When a batch gives up on a call that is stuck past its
deadline, the sender retires that set: its threads end once their calls
return, and the next batch of that size gets a new set, so a stuck call
never holds up later batches.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

Task = Callable[[], None]


class Countdown:
    """Counts the running tasks of one batch, which is done when the last
    one ends. The caller waits on a single lock, so it wakes once per batch
    rather than once per task (as it would with a Semaphore)."""

    def __init__(self, tasks: int) -> None:
        self._left = tasks
        self._count = threading.Lock()
        self._ended = threading.Lock()
        if tasks > 0:
            self._ended.acquire()

    def add(self, tasks: int) -> bool:
        """Count ``tasks`` more. Returns False, and counts nothing, when every
        task has ended already."""
        with self._count:
            if self._left == 0:
                return False
            self._left += tasks
            return True

    def task_done(self) -> None:
        with self._count:
            self._left -= 1
            if self._left == 0:
                self._ended.release()

    def wait(self, timeout: float) -> bool:
        """True once every task has ended; False after ``timeout`` seconds."""
        if self._ended.acquire(timeout=max(0.0, timeout)):
            self._ended.release()  # so that a later wait also sees the end
            return True
        return False


class SendThreads:
    """A fixed set of daemon threads that run send tasks.

    This is not a ThreadPoolExecutor because the interpreter joins those
    threads at exit. A call stuck in a provider's read timeout past its
    deadline (already given up and settled as a retry) would then keep
    ``outbox worker`` from exiting after SIGTERM. Daemon threads never hold
    the process."""

    def __init__(self, size: int, name_prefix: str = "send") -> None:
        self.size = size
        self._tasks: queue.SimpleQueue[tuple[Task, Countdown] | None] = queue.SimpleQueue()
        for n in range(size):
            threading.Thread(target=self._serve, name=f"{name_prefix}_{n}", daemon=True).start()

    def _serve(self) -> None:
        while (item := self._tasks.get()) is not None:
            task, countdown = item
            try:
                task()
            except BaseException:  # one task's failure must not end the thread
                log.exception("send task failed")
            finally:
                countdown.task_done()

    def start(self, task: Task, copies: int) -> Countdown:
        """Run ``copies`` of ``task`` side by side. The countdown returned says
        when all of them have ended."""
        countdown = Countdown(copies)
        for _ in range(copies):
            self._tasks.put((task, countdown))
        return countdown

    def add(self, countdown: Countdown, task: Task, copies: int) -> None:
        """Run ``copies`` more of ``task`` under the same countdown, unless all
        of its tasks have ended already (then no work is left to share)."""
        if countdown.add(copies):
            for _ in range(copies):
                self._tasks.put((task, countdown))

    def retire(self) -> None:
        """Each thread ends once it has finished what it runs now. Tasks that
        were queued before this still run."""
        for _ in range(self.size):
            self._tasks.put(None)


class Pools:
    """The send threads of this process, one set per size."""

    def __init__(self) -> None:
        self._by_size: dict[int, SendThreads] = {}
        self._lock = threading.Lock()

    def get(self, size: int) -> SendThreads:
        """The set of ``size`` threads, started on first use."""
        with self._lock:
            threads = self._by_size.get(size)
            if threads is None:
                threads = self._by_size[size] = SendThreads(size)
            return threads

    def retire(self, threads: SendThreads) -> None:
        """Retire ``threads``; the next ``get`` of their size starts a new set."""
        with self._lock:
            if self._by_size.get(threads.size) is threads:
                del self._by_size[threads.size]
        threads.retire()

    def forget_in_child(self) -> None:
        """A forked process inherits the sets but none of their threads, so
        its sends would wait for ever. It starts sets of its own instead."""
        self._by_size.clear()
        self._lock = threading.Lock()


pools = Pools()
os.register_at_fork(after_in_child=lambda: pools.forget_in_child())
