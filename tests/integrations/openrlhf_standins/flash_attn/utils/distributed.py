from typing import Any


def all_gather(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("flash-attn stand-in: ring attention needs the CUDA build")
