"""Downstream tasks run on a trained checkpoint: ``python tasks/main.py --task ...``."""
