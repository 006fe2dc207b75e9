"""opencl backend (under construction)."""
