"""Adapters that let outside runtimes keep their states in statecache.

Each subpackage is named for the runtime it adapts (``transformers``) and
imports that runtime lazily, on first use: nothing else in the core imports
this package, and it is the only part of the core allowed to import torch.
"""
