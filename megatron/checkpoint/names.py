"""Dotted names of nested state dicts, whatever their nesting.

A model's state dict nests (``{"language_model": {"encoder": {...}}}``) and a saved one may nest
differently from the live model (``{"dense.weight": t}`` beside ``{"dense": {"weight": t}}``);
checkpoint loading, the optimizer-state naming and the converter address tensors by their dotted
name through these two functions.
"""

from typing import List


def dotted_names(tree, prefix: str = "") -> List[str]:
    names = []
    for key, value in tree.items():
        if isinstance(value, dict):
            names += dotted_names(value, f"{prefix}{key}.")
        else:
            names.append(f"{prefix}{key}")
    return names


def lookup_dotted(tree, dotted: str):
    """The value at dotted key ``dotted`` of a nested ``tree`` whatever its nesting
    (``{"lm_head": {"dense.weight": t}}`` and ``{"lm_head": {"dense": {"weight": t}}}`` alike),
    or None."""
    if not isinstance(tree, dict):
        return None
    if dotted in tree:
        return tree[dotted]
    for key, child in tree.items():
        if isinstance(child, dict) and dotted.startswith(f"{key}."):
            found = lookup_dotted(child, dotted[len(key) + 1:])
            if found is not None:
                return found
    return None
