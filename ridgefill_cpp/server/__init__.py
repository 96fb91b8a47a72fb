"""llama.cpp's own llama-server, built from the patched tree, with RidgeFill (:mod:`.serve`)."""

from .serve import Server, ServerError, serve

__all__ = ["Server", "ServerError", "serve"]
