"""Test models: tiny random-weight GGUF models of every supported architecture (:mod:`.tiny_models`,
with the family builders :mod:`.tiny_dense_more`, :mod:`.tiny_gpt_oss`, :mod:`.tiny_qwen35` and
their shared :mod:`.tiny_gguf`) and synthetic map files (:mod:`.synthetic_maps`), for the tests, the
measurement tools and the GPU device run. Imports :mod:`ridgefill_cpp.core` and
:mod:`ridgefill_cpp.maps` only."""
