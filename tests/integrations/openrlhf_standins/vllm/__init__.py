"""The names OpenRLHF 0.11 imports from vLLM at module level (see ../README.md)."""

from typing import Any

__version__ = "0.29.0"


class SamplingParams:
    """vLLM's sampling parameters: kept as given (the stand-in engines read none)."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class AsyncEngineArgs(SamplingParams):
    pass
