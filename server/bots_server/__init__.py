"""BOTS selection service: Bayesian online task selection over gRPC."""

__version__ = "0.1.0"
