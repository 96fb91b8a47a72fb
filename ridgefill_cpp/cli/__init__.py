"""``ridgefill-gguf``: the command line of ridgefill-cpp (a typer app; the formatting lives here only).

:mod:`.app` holds the app and what the commands share (the consoles, the error exit, output-path
checks, options several commands parse alike); each command is a module of its own (``fit``,
``info``, ``bench``, ``eval``, ``tune``, ``serve``, ``rpc_server``, ``digest``, ``models``,
``demo``) with its options, its help and the call into the library, and :mod:`.show` the tables
several of them print. Each command imports the modules it runs inside its function: ``--help``,
``--version`` and the light commands do not pay for numpy, torch and llama.cpp at start-up. The
defaults come from :mod:`ridgefill_cpp.core.settings` (options left out are None and resolve
there, through the library).
"""

from __future__ import annotations

import importlib

from .app import app

#: the command modules, in the order ``ridgefill-gguf --help`` lists their commands
COMMANDS = ("info", "fit", "bench", "eval", "serve", "rpc_server", "digest", "models", "demo", "tune")

for _name in COMMANDS:
    importlib.import_module(f"{__name__}.{_name}")  # registers the command with app
del _name

__all__ = ["app"]
