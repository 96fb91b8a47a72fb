"""Filled-row prefill from Python: :class:`~.prefill.RidgeFill` and :class:`~.prefill.Llama`
(:mod:`.prefill`), map files loaded into libllama (:mod:`.native_maps`), and models split over
llama.cpp's RPC servers (:mod:`.rpc`). Imports :mod:`ridgefill_cpp.core` and :mod:`ridgefill_cpp.maps`."""
