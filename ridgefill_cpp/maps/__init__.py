"""Map files: the format, read and written (:mod:`.mapfile`), compact (quantized and low-rank) maps
(:mod:`.compact`), the model fingerprint they record (:mod:`.fingerprint`), and GGUF copies
(:mod:`.gguf_copy`). Imports :mod:`ridgefill_cpp.core` only."""
