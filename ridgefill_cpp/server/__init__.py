"""llama.cpp's own llama-server, built from the patched tree, with RidgeFill (:mod:`.serve`):
:class:`~.serve.Server` starts, checks and stops it; :func:`.serve.serve` runs it in the foreground."""

from .serve import Server, ServerError

__all__ = ["Server", "ServerError"]
