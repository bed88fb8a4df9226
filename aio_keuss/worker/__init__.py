"""Running consumers as a service: ``run_worker`` (signals, grace, health endpoint) and the
``aio-keuss worker`` command built on it."""

from .run import run_worker

__all__ = ["run_worker"]
