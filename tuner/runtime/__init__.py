"""Backends. A loader builds a session once; a runner runs feeds -> outputs (Polygraphy's
split), so the accuracy gate, the benchmark and the server share one interface."""

from tuner.runtime.base import Runner, SessionSettings

__all__ = ["Runner", "SessionSettings"]
