"""Reliability tests: faults caused on purpose, and proof that nothing is lost or hangs."""
