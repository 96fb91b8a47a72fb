"""Making the maps: calibration and evaluation text (:mod:`.corpus`), hidden states from llama.cpp
(:mod:`.capture`), the ridge fit (:mod:`.fit`) and the terminal-state gains of hybrid models
(:mod:`.state_gains`). Imports the runtime, maps and core."""
