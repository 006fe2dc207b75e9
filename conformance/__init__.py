"""The statecache conformance suite (pytest plugin + cases)."""
