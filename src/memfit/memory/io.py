"""The weight store's I/O: request sizes, the read call (injectable, for fault tests) and a
small pool of reader threads where demand reads go ahead of prefetches.

Kept apart from store.py so bandwidth.py's probe can use the same request shape without
importing the store (planner -> bandwidth -> store -> planner was a circle).
"""

from __future__ import annotations

import heapq
import itertools
import os
import signal
import threading
from typing import Callable

PAGE = 4096
IO_CHUNK = 4 << 20      # bytes per read request
IO_WORKERS = 4          # requests in flight (disk queue depth)
DEMAND, PREFETCH = 0, 1  # request priorities: lower is served first

# reader(fd, buffer, offset) -> bytes read (0 at end of file); raises OSError on failure
Reader = Callable[[int, memoryview, int], int]


def os_pread(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


ASYNC_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM,
                 signal.SIGCHLD, signal.SIGWINCH, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE}


def block_async_signals() -> None:
    """Called first in a helper thread: the process's asynchronous signals (Ctrl-C's SIGINT,
    SIGTERM) are delivered to another thread. Python runs their handlers in the main thread,
    and a main thread waiting in input() or a read sees them only when the signal interrupts
    it there (csrc/pool.c's workers do the same)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)


_cb_lock = threading.Lock()   # a Done's state and callbacks; when_all's counters


class Done:
    """A request's completion, as much of concurrent.futures.Future as the store uses (done,
    exception and result wait; add_done_callback; set_result, set_exception). Why not Future:
    each Future builds a Condition (an RLock and a lock), and a streamed MoE decode makes ~10
    of these a read and ~60 reads a token (issue 22: the Futures were among the top entries of
    the streamed path's Python). A Done is a lock held until it completes."""

    __slots__ = ("_lock", "_err", "_cbs", "_done")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._err: BaseException | None = None
        self._cbs: list | None = []
        self._done = False

    def done(self) -> bool:
        return self._done

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits until done; the error it ended with, else None."""
        if not self._done:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError("the read did not finish in time")
            self._lock.release()
        return self._err

    def result(self, timeout: float | None = None):
        err = self.exception(timeout)
        if err is not None:
            raise err

    def set_result(self, _value=None) -> None:
        self._finish(None)

    def set_exception(self, err: BaseException) -> None:
        self._finish(err)

    def _finish(self, err: BaseException | None) -> None:
        self._err = err
        with _cb_lock:
            self._done = True
            cbs, self._cbs = self._cbs, None
        self._lock.release()
        for fn in cbs:
            fn(self)

    def add_done_callback(self, fn) -> None:
        with _cb_lock:
            if not self._done:
                self._cbs.append(fn)
                return
        fn(self)


class IOPool:
    """IO_WORKERS threads taking requests by (priority, arrival); submit returns a Done."""

    def __init__(self, workers: int = IO_WORKERS, name: str = "memfit-io"):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self._idle = 0          # workers waiting on _cv
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, prio: int, fn, *args) -> Done:
        fut = Done()
        self.submit_batch([(prio, fut, fn, args)])
        return fut

    def submit_batch(self, batch: list) -> None:
        """Queue [(prio, done, fn, args)] under one lock and wake at most as many workers as
        are waiting and there are requests: a worker woken needs the GIL, and each wake-up
        made while the caller still has requests to queue takes it from the caller (issue 22:
        one notify per request was a third of the streamed MoE path's read issue)."""
        if not batch:
            return
        with self._cv:
            assert not self._stop, "I/O pool is shut down"
            for prio, fut, fn, args in batch:
                heapq.heappush(self._heap, (prio, next(self._seq), fut, fn, args))
            wake = min(len(batch), self._idle)
            if wake:
                self._cv.notify(wake)

    def _work(self) -> None:
        block_async_signals()
        while True:
            with self._cv:
                while not self._heap and not self._stop:
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
                if not self._heap:
                    return
                _, _, fut, fn, args = heapq.heappop(self._heap)
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                fut.set_exception(e)
            else:
                fut.set_result()

    def shutdown(self) -> None:
        """Finish what was queued, then stop the threads."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()


def when_all(futs: list[Done]) -> Done:
    """A Done done when every one of futs is done (none left writing), carrying the first
    exception among them, else None (one of them: itself)."""
    if len(futs) == 1:
        return futs[0]
    out = Done()
    if not futs:
        out.set_result(None)
        return out
    left = [len(futs)]

    def one(_f):
        with _cb_lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            err = next((f.exception() for f in futs if f.exception() is not None), None)
            if err is None:
                out.set_result(None)
            else:
                out.set_exception(err)

    for f in futs:
        f.add_done_callback(one)
    return out
