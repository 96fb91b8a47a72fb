"""The base every other part stands on: the patched libraries and their C API (:mod:`.native`), the
settings vocabulary with libllama's defaults (:mod:`.settings`), the ranges values must be in before
they cross into C (:mod:`.limits`), llama.cpp's log (:mod:`.log`), GGUF model inspection
(:mod:`.gguf_model`), the default real models (:mod:`.models`), atomic file writes (:mod:`.files`) and
child processes (:mod:`.processes`). Imports nothing else of the package."""
