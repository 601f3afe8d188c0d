"""Experiments, batches and the step loop: engine + store under one experiment lock."""

from bots_server.core.selector import SelectorService

__all__ = ["SelectorService"]
