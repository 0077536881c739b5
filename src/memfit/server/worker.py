"""The one thread that owns the batch engine (the Engine is not thread-safe).

asyncio handlers hand it commands through a thread-safe queue; it runs ``engine.step()`` while
anything is unfinished and sends each StepOutput back to the handler's asyncio.Queue with
``loop.call_soon_threadsafe``. It also keeps the server's own bounded queue: at most
``n_parallel`` requests are inside the engine, the rest wait here in arrival order and are
refused (QueueTimeout) if they wait longer than ``queue_timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..errors import MemfitError


class QueueTimeout(Exception):
    """The request waited in the server's queue longer than the timeout."""


@dataclass(eq=False)
class Job:
    """One request in flight; the handler awaits ``out``: (index, StepOutput | Exception).
    The jobs of one HTTP request (n choices, several prompts) share one ``out`` queue and are
    told apart by ``index``."""

    prompt_ids: list[int]
    params: object                  # SamplingParams
    n_top: int
    loop: asyncio.AbstractEventLoop
    ignore_eos: bool = False        # llama-server's extension (benchmarks: fixed lengths)
    constraint: object = None       # memfit.constrain.Grammar (structured output, tool calls)
    index: int = 0                  # the choice this job answers
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    rid: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_checked: float = field(default_factory=time.perf_counter)  # client last seen (handler)
    done: bool = False


def _settle(fut: asyncio.Future, res, err) -> None:
    if not fut.done():  # a handler cancelled meanwhile (its client went away) drops it
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(res)


class EngineWorker:
    def __init__(self, engine, n_parallel: int, queue_timeout: float, on_stats=None):
        self.engine = engine
        self.n_parallel = n_parallel
        self.queue_timeout = queue_timeout
        self.on_stats = on_stats        # called with the engine's stats() after each step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.pending = 0                # submitted and not finished (handlers read it)
        self.stats: dict = dict(engine.stats())
        self.queued = 0
        self._thread = threading.Thread(target=self._run, name="memfit-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)

    # --- called from the asyncio thread
    def submit(self, job: Job) -> None:
        with self._lock:
            self.pending += 1
        self._inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        self._inbox.put(("abort", job))

    def call(self, fn) -> asyncio.Future:
        """Run ``fn()`` on the engine thread between two steps (the model and the KV pool are
        not thread-safe: /v1/embeddings runs its forwards this way); await its result."""
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    # --- the engine thread
    def _send(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, (job.index, item))
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def _finish(self, job: Job, item=None) -> None:
        if job.done:
            return
        job.done = True
        if item is not None:
            self._send(job, item)
        with self._lock:
            self.pending -= 1

    def _command(self, cmd: str, job: Job | None) -> bool:
        if cmd == "stop":
            return False
        if cmd == "add":
            self._waiting.append(job)
        elif cmd == "call":
            fn, fut = job
            try:
                res, err = fn(), None
            except Exception as e:  # noqa: BLE001 - the awaiting handler reports it
                res, err = None, e
            try:
                fut.get_loop().call_soon_threadsafe(_settle, fut, res, err)
            except RuntimeError:  # the event loop is closed (shutdown)
                pass
        elif cmd == "abort" and not job.done:
            if job.rid is not None:
                self.engine.abort(job.rid)
                self._jobs.pop(job.rid, None)
            else:
                self._waiting.remove(job)
            self._finish(job)
        return True

    def _admit(self) -> None:
        now = time.perf_counter()
        while self._waiting and now - self._waiting[0].t_submit > self.queue_timeout:
            job = self._waiting.popleft()
            self._finish(job, QueueTimeout(f"waited {now - job.t_submit:.1f} s in the queue"))
        while self._waiting and len(self._jobs) < self.n_parallel:
            job = self._waiting.popleft()
            try:
                kw = {} if job.constraint is None else {"constraint": job.constraint}
                job.rid = self.engine.add_request(job.prompt_ids, job.params, n_top=job.n_top,
                                                  ignore_eos=job.ignore_eos, **kw)
            except MemfitError as e:
                self._finish(job, e)
                continue
            self._jobs[job.rid] = job
        self.queued = len(self._waiting)

    def _run(self) -> None:
        eng = self.engine
        while True:
            busy = eng.has_unfinished() or bool(self._waiting)
            try:  # block only when there is nothing to step
                cmd = self._inbox.get(timeout=0.25) if not busy else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if not self._command(*cmd):
                    self._fail_all(RuntimeError("the server is shutting down"))
                    return
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            self._admit()
            if eng.has_unfinished():
                try:
                    outs = eng.step()
                except Exception as e:  # noqa: BLE001 - keep serving; fail the batch that hit it
                    traceback.print_exc(file=sys.stderr)
                    self._fail_all(e)
                    continue
                for o in outs:
                    job = self._jobs.get(o.request_id)
                    if job is None:  # aborted meanwhile
                        continue
                    self._send(job, o)
                    if o.finished:
                        del self._jobs[o.request_id]
                        self._finish(job)
            self.stats = dict(eng.stats())
            if self.on_stats is not None:
                self.on_stats(self.stats)

    def _fail_all(self, err: Exception) -> None:
        for rid, job in list(self._jobs.items()):
            self.engine.abort(rid)
            self._finish(job, err)
        self._jobs.clear()
        while self._waiting:
            self._finish(self._waiting.popleft(), err)
