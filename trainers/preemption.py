"""Signals only set a flag; the ranks agree on stopping at a step boundary (never in a handler).

The flag also says which phase of the run the signal hit (start-up, resume, training,
evaluation, saving): the loop names its phase as it goes, and the stop line reports it.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field


@dataclass
class StopFlag:
    """Set by SIGUSR1/SIGUSR2 (Slurm's --signal, preempt_send_user_signal) and SIGTERM."""

    signal_name: str | None = None
    received_at: float | None = None
    phase: str = "start-up"  # what the rank is doing now (set by the loop)
    received_in: str | None = None  # the phase the first signal arrived in
    _previous: dict[int, object] = field(default_factory=dict)

    def install(self, signals: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)) -> StopFlag:
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.note(signal.Signals(signum).name, time.time(), self.phase)

    def note(self, signal_name: str, received_at: float, phase: str) -> None:
        """A stop request; the first one says why and when (one caught before this flag existed
        is handed over the same way)."""
        if self.signal_name is None:
            self.signal_name, self.received_at, self.received_in = signal_name, received_at, phase

    def reclaim(self) -> None:
        """Install the handler again for the signals it owns: a library that set its own since
        (NCCL 2.12 caught SIGUSR1 in its proxy thread; RCCL may catch SIGUSR2) would hide a
        preemption notice from training. Called after the collectives start."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
