"""ridgefill-cpp."""
