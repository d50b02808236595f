"""Tandem: an LLM serving engine with SGLang's process architecture."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str):
    # Lazy, so `import tandem` stays cheap for tools that need neither.
    if name == "Engine":
        from tandem.entrypoints.engine import Engine

        return Engine
    if name == "ServerArgs":
        from tandem.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(name)
