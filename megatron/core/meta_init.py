"""Building a model on the meta device and materialising it one piece at a time
(``--init-model-with-meta-device``).

A model here is built from pieces, each inside its own seeded RNG fork
(``megatron.model.utils.init_rng``: the embedding, each layer, the final norm, the output
layer), so a piece's weights depend on nothing built before it. That makes a cheap exact
materialisation possible without recording any initialiser:

1. :func:`building` with ``real=None``: the whole model is built on the meta device (no
   memory, no random draws inside the pieces) and the top-level pieces are listed in order;
2. the caller shards it (FSDP2 accepts a meta model) and allocates the shards;
3. for each piece (and once for what is built outside every piece), the model is built again
   with only that piece on the real device, from the same RNG state as the first build; its
   tensors are exactly those of an ordinary build, and each rank copies its shard of them into
   the sharded model, then drops the piece.

Peak memory is one piece (one layer) beside the sharded model; the weights are bit for bit
those of an ordinary build with the same seed.
"""

import contextlib
from typing import List, Optional

import torch

from megatron.core import device

OUTSIDE = "<outside every piece>"   # what is built outside every init_rng piece


class _Session:
    def __init__(self, real: Optional[str]):
        self.real = real          # the piece built on the real device (None: nothing)
        self.depth = 0
        self.current: Optional[str] = None
        self.pieces: List[str] = []


_SESSION: Optional[_Session] = None


def active() -> bool:
    return _SESSION is not None


@contextlib.contextmanager
def building(real: Optional[str] = None):
    """Build a model inside: tensors go to the meta device except those of piece ``real``
    (:data:`OUTSIDE`: those built outside every piece; None: none). Yields the list that
    receives the names of the top-level pieces as they are entered."""
    global _SESSION
    if _SESSION is not None:
        raise RuntimeError("a meta-device build is already in progress")
    _SESSION = _Session(real)
    try:
        with device.placing_tensors_on(None if real == OUTSIDE else torch.device("meta")):
            yield _SESSION.pieces
    finally:
        _SESSION = None


@contextlib.contextmanager
def piece(name: str):
    """Entered by ``init_rng`` around each piece: inside a build session the piece's tensors go
    to the real device only if it is the session's ``real`` piece (nested pieces follow their
    top-level piece)."""
    session = _SESSION
    if session is None:
        yield
        return
    top = session.depth == 0
    if top:
        session.pieces.append(name)
        session.current = name
    session.depth += 1
    target = None if session.current == session.real else torch.device("meta")
    try:
        with device.placing_tensors_on(target):
            yield
    finally:
        session.depth -= 1
        if top:
            session.current = None


def skips_draws() -> bool:
    """Whether an initialiser may skip drawing the values of a meta tensor: inside a piece
    (whose RNG is a fork of its own, so nothing after it sees the difference)."""
    return _SESSION is not None and _SESSION.depth > 0
