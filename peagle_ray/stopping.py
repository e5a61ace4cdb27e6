"""Stop signals: SIGTERM and SIGHUP are handled like Ctrl-C (KeyboardInterrupt), so every `finally` runs and
the endpoint, Ray and the MLflow server stop; the CLI then exits 128 + the signal number.

    previous = install()      # the CLI, around one command
    ...                       # ray.init() replaces SIGTERM's handler (sys.exit(15)); ensure_ray() calls reinstall()
    restore(previous)
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
received: list[int] = []  # the stop signals caught, last one last
_installed = False


def _interrupt(signum, frame):
    received.append(signum)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install() -> dict:
    """Handle the stop signals as Ctrl-C; returns the handlers replaced (none outside the main thread)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {signum: signal.signal(signum, _interrupt) for signum in STOP_SIGNALS}
    _installed = True
    return previous


def reinstall() -> None:
    """Take the stop signals back after a library replaced their handlers (ray.init does, for SIGTERM)."""
    if _installed and threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _interrupt)


def restore(previous: dict) -> None:
    global _installed
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    _installed = False


def last_signal() -> int:
    """The stop signal that interrupted the command, SIGINT (Ctrl-C) if none."""
    return received[-1] if received else signal.SIGINT
