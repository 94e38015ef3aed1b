"""Checkpoint conversion: Megatron layouts (any TP / PP) and Hugging Face folders, streamed a
layer at a time through the canonical form of :mod:`megatron.convert.schema`."""
