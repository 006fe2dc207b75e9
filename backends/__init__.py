"""Built-in backends.  Each subpackage registers itself through the
``statecache.backends`` entry-point group, exactly as a third-party one would;
nothing here is imported by the core."""
