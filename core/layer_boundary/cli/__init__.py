"""The ``layer-boundary`` command line. Nothing in the library imports it."""
