"""The in-process signal bus: queue objects of one process wake each other directly."""

from __future__ import annotations

from .base import SignalBus


class LocalSignalBus(SignalBus):
    """No transport: :class:`SignalBus` already delivers to this process's subscribers."""
