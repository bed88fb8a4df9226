"""Signal buses: ``local`` here; each server backend brings the bus of its own database."""

from .base import Signal, SignalBus
from .local import LocalSignalBus

__all__ = ["LocalSignalBus", "Signal", "SignalBus"]
