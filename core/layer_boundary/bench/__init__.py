"""Benchmarks behind ``layer-boundary bench``. Speed is measured here, never in tests."""
