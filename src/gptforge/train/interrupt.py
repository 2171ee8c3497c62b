"""Ctrl-C / SIGTERM during training: finish the current step, save it, then stop.

While a training loop runs, the first SIGINT or SIGTERM only sets a flag (the loop saves a
checkpoint of the step it is on and raises `TrainingInterrupted`); the signal's previous handler
is put back at once, so a second Ctrl-C interrupts immediately and a second SIGTERM kills.
`gptforge` exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM), and
`--resume auto` continues from the saved step exactly.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by a signal after saving `checkpoint` (the state after `step` updates)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        saved = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint (nothing trained yet)"
        super().__init__(f"{signal_name(signum)} at step {step}: {saved}; continue with --resume auto")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """`with StopSignals() as stop:` ... `stop.signum` is set once SIGINT/SIGTERM arrived. Handlers
    are installed only in the main thread (elsewhere signals keep their behaviour)."""

    def __init__(self, what: str = "training"):
        self.what = what
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for s in SIGNALS:
            with contextlib.suppress(ValueError, OSError):  # ValueError: not the main thread
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signum, self._previous.pop(signum, signal.SIG_DFL))
        again = "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
        print(f"gptforge: {signal_name(signum)}: saving a checkpoint at the end of this step, then stopping "
              f"({again} again stops at once, unsaved)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(s, h)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None




def stop_run(signum: int | None, step: int, checkpoint: Path | None, log) -> None:
    """A signal arrived and the run saved `checkpoint` (None: nothing trained yet): a `stop`
    record and line, then `TrainingInterrupted`. `signum` None: another rank received it."""
    signum = signum or signal.SIGTERM
    err = TrainingInterrupted(signum, step, checkpoint)
    log.record("stop", step, {"reason": "signal", "signal": signal_name(signum), "last_checkpoint": str(checkpoint)})
    log.info(f"[stop] {err}")
    raise err


__all__ = ["StopSignals", "TrainingInterrupted", "signal_name", "stop_run"]
