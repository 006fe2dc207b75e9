"""cuda backend (under construction)."""
