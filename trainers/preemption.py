"""Signals only set a flag; the ranks agree on stopping at a step boundary (never in a handler)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field


@dataclass
class StopFlag:
    """Set by SIGUSR1/SIGUSR2 (Slurm's --signal, preempt_send_user_signal) and SIGTERM."""

    signal_name: str | None = None
    received_at: float | None = None
    _previous: dict[int, object] = field(default_factory=dict)

    def install(self, signals: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)) -> StopFlag:
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is None:  # the first signal says why we stop
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.time()

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
