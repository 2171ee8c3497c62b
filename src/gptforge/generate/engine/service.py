"""`EngineService`: the engine on a thread of its own, for servers. Requests arrive from any
thread (`submit` / `cancel`); the thread schedules under a lock (cheap bookkeeping) and runs the
model step outside it. Events reach each request's `sink` on the engine thread.
"""

from __future__ import annotations

import threading

import torch

from gptforge.generate.engine.core import EngineCore
from gptforge.generate.engine.sequence import QueueFull, Request, ShuttingDown

__all__ = ["EngineService", "QueueFull", "ShuttingDown"]


class EngineService:
    """A started `EngineCore` serving requests until `stop()`."""

    def __init__(self, core: EngineCore):
        self.core = core
        self._after_step: list = []
        self._cv = threading.Condition()
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- any thread -----------------------------------------------------------------------------

    def start(self) -> EngineService:
        self._thread = threading.Thread(target=self._loop, name="gptforge-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, req: Request) -> None:
        """Queue a request's sequences; raises `QueueFull` or `ShuttingDown`."""
        with self._cv:
            if self._draining or self._stop:
                raise ShuttingDown("the server is shutting down")
            self.core.add(req)
            self._gauges()
            self._cv.notify()

    def on_step(self, hook) -> None:
        """Call `hook()` on the engine thread after each step (and after `abort_all`): a server
        hands the events its sinks collected during the step to its event loop at once."""
        self._after_step.append(hook)

    def cancel(self, req: Request) -> None:
        """Stop a request (its client went away); its slots are freed at the next step."""
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def drain(self) -> None:
        """Refuse new requests from now on; running and queued ones continue."""
        with self._cv:
            self._draining = True

    def idle(self) -> bool:
        with self._cv:
            return not self.core.has_work

    def abort_all(self) -> None:
        """Finish every queued and running sequence now (reason `abort`)."""
        with self._cv:
            sch = self.core.scheduler
            for s in list(sch.waiting) + list(sch.running):
                s.req.cancelled = True
                self.core.output.finish(s, "abort", "")
            self._cv.notify()
        self._stepped()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- what servers and tests read ------------------------------------------------------------

    @property
    def slots(self):
        return self.core.slots

    @property
    def queue_depth(self) -> int:
        return len(self.core.scheduler.waiting)

    @property
    def batch_size(self) -> int:
        return len(self.core.scheduler.running)

    @property
    def peak_batch(self) -> int:
        return self.core.scheduler.peak_batch

    @peak_batch.setter
    def peak_batch(self, value: int) -> None:
        self.core.scheduler.peak_batch = value

    @property
    def max_queue(self) -> int:
        return self.core.scheduler.cfg.max_queue

    @max_queue.setter
    def max_queue(self, value: int) -> None:
        self.core.scheduler.cfg.max_queue = value

    @property
    def steps(self) -> int:
        return self.core.steps

    @property
    def drafted(self) -> int:
        return self.core.stats.drafted if self.core.stats else 0

    @property
    def accepted(self) -> int:
        return self.core.stats.accepted if self.core.stats else 0

    # -- engine thread --------------------------------------------------------------------------

    def _gauges(self) -> None:
        hook = getattr(self.core.metrics, "on_queue", None)
        if hook is not None:
            hook(self.queue_depth, self.batch_size)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stop and not self.core.has_work:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                plan = self.core.schedule()
                self._gauges()
            try:
                if plan:
                    with torch.inference_mode():
                        self.core.step(plan)
                with self._cv:
                    self.core.scheduler.drop_cancelled()
                    self._gauges()
            finally:
                self._stepped()

    def _stepped(self) -> None:
        for hook in self._after_step:
            hook()
