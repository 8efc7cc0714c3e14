"""The serving engines decodescope can launch, profile and read (engines/base.py: what each provides).

    engine("vllm") -> the vLLM implementation; ENGINES lists the names params may give (server.engine).
"""
from __future__ import annotations

from decodescope.engines.base import Engine
from decodescope.engines.vllm import VLLM

ENGINES: dict[str, Engine] = {"vllm": VLLM()}
DEFAULT_ENGINE = "vllm"


def engine(name: str = DEFAULT_ENGINE) -> Engine:
    """The engine of that name; a ValueError naming the valid ones otherwise."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"engine {name!r} is not one decodescope knows; valid: {', '.join(sorted(ENGINES))}") from None


__all__ = ["DEFAULT_ENGINE", "ENGINES", "Engine", "engine"]
