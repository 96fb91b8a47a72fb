"""Measuring it: timing against stock prefill (:mod:`.bench`), quality against exact prefill
(:mod:`.evaluate`, :mod:`.metrics`, :mod:`.report`) and the choice of an operating point
(:mod:`.tune`). Imports the parts below it (fitting, runtime, maps, core)."""
