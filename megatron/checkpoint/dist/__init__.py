"""Megatron-Core's ``torch_dist`` checkpoint format (``--ckpt-format torch_dist``).

* :mod:`.keys`: this project's model state names to Megatron-Core's global keys, shapes and
  per-rank offsets (:class:`ChunkLayout`, :func:`placements`).
* :mod:`.reader`: a safe reader of any slice of any tensor and of byte entries, without a
  process group (:class:`DistCheckpointReader`), and safe replacements for the two unsafe
  parts of ``torch.distributed.checkpoint.load`` (:class:`SafeFileSystemReader`,
  :class:`SafeLoadPlanner`, defined in :mod:`.dcp_load` and imported when first named: they
  subclass ``torch.distributed.checkpoint``'s classes, whose import a run that never touches a
  torch_dist folder does not pay).
* :mod:`.writer`: per-writer data files and the shared metadata (:class:`ShardWriter`,
  :func:`write_metadata`; :func:`save_shards` from every rank at once).
* :mod:`.model_state`: a model chunk's state to shards and back at any layout.
"""

from megatron.checkpoint.dist.keys import (ChunkLayout, KeyMappingError, Placement, object_key,
                                           placements)
from megatron.checkpoint.dist.model_state import (chunk_layout, common_objects, extra_state_objects,
                                                  flat_boxes, load_model_state, model_shards,
                                                  optimizer_state_shards, range_shards, read_local,
                                                  read_local_rows, tensor_shards)
from megatron.checkpoint.dist.reader import (DistCheckpointError, DistCheckpointReader,
                                             is_dist_checkpoint)
from megatron.checkpoint.dist.writer import (DistCheckpointWriteError, ObjectShard, ShardWriter,
                                             TensorShard, save_shards, write_metadata)

__all__ = [
    "ChunkLayout", "KeyMappingError", "Placement", "object_key", "placements",
    "chunk_layout", "common_objects", "extra_state_objects", "load_model_state", "model_shards",
    "optimizer_state_shards", "read_local", "tensor_shards", "flat_boxes", "range_shards",
    "read_local_rows",
    "DistCheckpointError", "DistCheckpointReader", "SafeFileSystemReader", "SafeLoadPlanner",
    "is_dist_checkpoint",
    "DistCheckpointWriteError", "ObjectShard", "ShardWriter", "TensorShard", "save_shards",
    "write_metadata",
]


def __getattr__(name: str):
    if name in ("SafeFileSystemReader", "SafeLoadPlanner"):
        from megatron.checkpoint.dist import dcp_load

        return getattr(dcp_load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
