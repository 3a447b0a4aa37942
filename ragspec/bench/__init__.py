"""Benchmarks (`ragspec bench`): speed is measured here, never asserted in tests."""
