"""pytest plugin entry point of the conformance suite (under construction)."""
