"""BOTS selection service: Bayesian online task selection over gRPC."""

# The release: bots-client's __version__, the pin on it in pyproject.toml, the
# proto's header, the image tags and CHANGELOG.md say the same
# (tests/ops/test_cli_version.py). pyproject.toml reads it from here.
__version__ = "0.2.0"
