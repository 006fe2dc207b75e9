"""cpu backend (under construction)."""
