"""Stats stores: ``memory`` here; each server backend brings the store of its own database."""

from .base import COUNTERS, StatsStore
from .memory import MemoryStats

__all__ = ["COUNTERS", "MemoryStats", "StatsStore"]
