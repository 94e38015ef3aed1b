"""Writing a ``torch_dist`` checkpoint folder: each writer its own data file, then one
``.metadata`` for all.

The folder is what ``torch.distributed.checkpoint.save`` with Megatron-Core's planner writes:

* ``__<rank>_0.distcp``: the items of one writer, each ``torch.save``d back to back (a tensor
  chunk as a contiguous tensor of exactly the chunk's sizes; a byte entry as the bytes of
  ``torch.save([obj])``, Megatron-Core's wrapping of its sharded objects);
* ``.metadata``: the pickled ``Metadata`` (``TensorStorageMetadata`` with every chunk of each
  key, ``BytesStorageMetadata`` for byte entries, and a ``_StorageInfo`` per item saying which
  file and byte range holds it);
* ``metadata.json``: ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1}``.

Two ways to use it:

* one process writing every rank's shards (the converter): a :class:`ShardWriter` per target
  rank, then :func:`write_metadata` with all their records;
* every rank writing only its own (training): :func:`save_shards`, a collective over the
  default (or given) process group: each rank writes its file, rank 0 gathers the records,
  checks that they tile every tensor exactly once, and writes the metadata.

``.metadata`` is written last, through a temporary name and a rename, after every data file is
fsynced: a folder without it is an unfinished save, which no reader accepts.
"""

import dataclasses
import io
import json
import os
import uuid
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint.dist.reader import (BACKEND, BACKEND_FILE, COMMON_FILE, COMMON_STATE_FQN,
                                             METADATA_FILE)
from megatron.checkpoint.publish import fsync_path

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

BACKEND_VERSION = 1
DCP_VERSION = "1.0.0"


class DistCheckpointWriteError(RuntimeError):
    """Records that do not form a checkpoint (overlap, gap, conflicting shapes); names the key."""


@dataclasses.dataclass
class TensorShard:
    """A piece of a global tensor: ``tensor`` sits at ``global_offset`` of ``key``.
    ``nd_orig_global_shape``: for a tensor stored N-D flattened, the shape it has unflattened
    (recorded in the metadata's ``mcore_data``, where Megatron-Core looks for it)."""

    key: str
    tensor: torch.Tensor
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    nd_orig_global_shape: Optional[Tuple[int, ...]] = None


@dataclasses.dataclass
class ObjectShard:
    """A byte entry: ``obj`` stored under ``fqn`` (see :func:`keys.object_key`), as
    Megatron-Core's ``torch.save([obj])``; ``listed=False``: as ``torch.save(obj)``, what
    ``torch.distributed.checkpoint.save`` writes for a plain object."""

    fqn: str
    obj: Any
    listed: bool = True


@dataclasses.dataclass
class Record:
    """Where one written item went (plain data: gathered across ranks)."""

    fqn: str
    file: str
    offset: int
    length: int
    chunk_offset: Optional[Tuple[int, ...]] = None     # None for a byte entry
    chunk_sizes: Optional[Tuple[int, ...]] = None
    global_shape: Optional[Tuple[int, ...]] = None
    dtype: Optional[torch.dtype] = None
    nd_orig_global_shape: Optional[Tuple[int, ...]] = None


def data_file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


class ShardWriter:
    """Appends one writer's items to ``__<rank>_0.distcp`` in ``path``.

    Items are written as they are added, so a caller streaming a model holds only the piece in
    hand. ``close()`` fsyncs the file and returns the records for :func:`write_metadata`.
    """

    def __init__(self, path: str, rank: int = 0):
        os.makedirs(path, exist_ok=True)
        self.file = data_file_name(rank)
        self._path = os.path.join(path, self.file)
        self._f = open(self._path, "wb")
        self.records: List[Record] = []

    def _append(self, payload: bytes) -> Tuple[int, int]:
        offset = self._f.tell()
        self._f.write(payload)
        return offset, len(payload)

    def add_tensor(self, key: str, tensor: torch.Tensor, global_shape: Sequence[int],
                   global_offset: Sequence[int],
                   nd_orig_global_shape: Optional[Sequence[int]] = None) -> None:
        """Store ``tensor`` as the chunk of ``key`` at ``global_offset`` (same number of dims
        as ``global_shape``); ``nd_orig_global_shape`` as :class:`TensorShard`'s."""
        global_shape, global_offset = tuple(global_shape), tuple(global_offset)
        if tensor.dim() != len(global_shape) or len(global_offset) != len(global_shape) or any(
                o < 0 or o + s > g for o, s, g in zip(global_offset, tensor.shape,
                                                      global_shape)):
            raise DistCheckpointWriteError(
                f"{key!r}: a piece of shape {tuple(tensor.shape)} at {list(global_offset)} does "
                f"not fit the global shape {list(global_shape)}")
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # torch.save writes the whole storage of a view
        buf = io.BytesIO()
        torch.save(tensor, buf)
        offset, length = self._append(buf.getbuffer())
        orig = tuple(nd_orig_global_shape) if nd_orig_global_shape is not None else None
        self.records.append(Record(key, self.file, offset, length, global_offset,
                                   tuple(tensor.shape), global_shape, tensor.dtype, orig))

    def add_object(self, fqn: str, obj: Any, listed: bool = True) -> None:
        """Store ``obj`` as the byte entry ``fqn``, as ``torch.save([obj])`` (``listed=False``:
        ``torch.save(obj)``). The common state is also written to ``common.pt`` beside it:
        Megatron-Core releases up to 0.16 read it from there, later ones from the byte entry."""
        buf = io.BytesIO()
        torch.save([obj] if listed else obj, buf)
        offset, length = self._append(buf.getbuffer())
        self.records.append(Record(fqn, self.file, offset, length))
        if fqn == COMMON_STATE_FQN:
            buf = io.BytesIO()
            torch.save(obj, buf)
            _write_atomic(os.path.join(os.path.dirname(self._path), COMMON_FILE),
                          buf.getvalue())

    def add(self, items: Iterable) -> None:
        for item in items:
            if isinstance(item, TensorShard):
                self.add_tensor(item.key, item.tensor, item.global_shape, item.global_offset,
                                item.nd_orig_global_shape)
            else:
                self.add_object(item.fqn, item.obj, item.listed)

    def close(self) -> List[Record]:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        return self.records

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_tiling(key: str, shape: Tuple[int, ...], chunks: List[Record]) -> None:
    """The chunks of ``key`` cover its global shape exactly once."""
    total = sum(int(torch.Size(r.chunk_sizes).numel()) for r in chunks)
    want = int(torch.Size(shape).numel())
    seen = set()
    for r in chunks:
        if r.chunk_offset in seen:
            raise DistCheckpointWriteError(f"{key!r}: two writers stored the chunk at "
                                           f"{list(r.chunk_offset)}")
        seen.add(r.chunk_offset)
    if total != want:
        raise DistCheckpointWriteError(f"{key!r}: the stored chunks hold {total} elements, the "
                                       f"global shape {list(shape)} has {want}")
    if len(chunks) > 1 and want <= (1 << 22):
        covered = torch.zeros(shape, dtype=torch.int8)
        for r in chunks:
            covered[tuple(slice(o, o + s) for o, s in zip(r.chunk_offset, r.chunk_sizes))] += 1
        if not bool((covered == 1).all()):
            raise DistCheckpointWriteError(f"{key!r}: the stored chunks overlap or leave gaps")


def build_metadata(records: Iterable[Record], checkpoint_id: str = "") -> "Metadata":
    """DCP ``Metadata`` for the items of every writer.

    Raises:
        DistCheckpointWriteError: one key stored with two global shapes or dtypes, as a tensor
            and as bytes, twice as bytes, or with chunks that do not tile it.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                       ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    tensors: Dict[str, List[Record]] = {}
    state_dict_metadata: Dict[str, Any] = {}
    storage_data = {}
    for r in records:
        if r.chunk_offset is None:
            if r.fqn in state_dict_metadata:
                raise DistCheckpointWriteError(f"byte entry {r.fqn!r} written twice")
            state_dict_metadata[r.fqn] = BytesStorageMetadata()
            storage_data[MetadataIndex(r.fqn)] = _StorageInfo(r.file, r.offset, r.length)
            continue
        if isinstance(state_dict_metadata.get(r.fqn), BytesStorageMetadata):
            raise DistCheckpointWriteError(f"{r.fqn!r} written as a tensor and as bytes")
        first = tensors.setdefault(r.fqn, [r])[0]
        if r is not first:
            tensors[r.fqn].append(r)
            if (first.global_shape, first.dtype) != (r.global_shape, r.dtype):
                raise DistCheckpointWriteError(
                    f"{r.fqn!r}: one writer says {list(first.global_shape)} {first.dtype}, "
                    f"another {list(r.global_shape)} {r.dtype}")
        state_dict_metadata.setdefault(r.fqn, None)
        storage_data[MetadataIndex(r.fqn, torch.Size(r.chunk_offset))] = _StorageInfo(
            r.file, r.offset, r.length)
    for key, chunks in tensors.items():
        shape = chunks[0].global_shape
        _check_tiling(key, shape, chunks)
        chunks = sorted(chunks, key=lambda r: r.chunk_offset)
        state_dict_metadata[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=chunks[0].dtype),
            size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(r.chunk_offset),
                                         sizes=torch.Size(r.chunk_sizes)) for r in chunks])
    metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data,
                        storage_meta=StorageMeta(checkpoint_id=checkpoint_id,
                                                 save_id=str(uuid.uuid4()), modules=[]),
                        version=DCP_VERSION)
    flattened = _nd_orig_global_shapes(tensors)
    if flattened:
        # Megatron-Core's planner records, per tensor key, the shape of an N-D flattened one.
        metadata.mcore_data = {key: ({"nd_reformulated_orig_global_shape": flattened[key]}
                                     if key in flattened else {}) for key in tensors}
    return metadata


def _nd_orig_global_shapes(tensors: Dict[str, List[Record]]) -> Dict[str, Tuple[int, ...]]:
    """Each N-D flattened key's unflattened shape, which all its writers must agree on."""
    found = {}
    for key, chunks in tensors.items():
        shapes = {r.nd_orig_global_shape for r in chunks}
        if len(shapes) > 1:
            raise DistCheckpointWriteError(f"{key!r}: writers disagree on its unflattened "
                                           f"shape ({sorted(map(str, shapes))})")
        shape = shapes.pop()
        if shape is not None:
            found[key] = tuple(shape)
    return found


def _write_atomic(path: str, payload: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def write_metadata(path: str, records: Iterable[Record], backend: bool = True) -> "Metadata":
    """Write ``metadata.json`` and then ``.metadata`` (last, atomically) for ``records``; the
    data files they name must already be complete (``ShardWriter.close``). ``backend=False``:
    no ``metadata.json`` (a plain ``torch.distributed.checkpoint`` folder)."""
    import pickle

    metadata = build_metadata(records, checkpoint_id=path)
    for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
        fsync_path(os.path.join(path, name))
    if backend:
        config = {"sharded_backend": BACKEND, "sharded_backend_version": BACKEND_VERSION}
        _write_atomic(os.path.join(path, BACKEND_FILE), json.dumps(config).encode())
    _write_atomic(os.path.join(path, METADATA_FILE), pickle.dumps(metadata))
    fsync_path(path)
    return metadata


def save_shards(path: str, items: Iterable, group=None,
                backend: bool = True) -> Optional["Metadata"]:
    """Every rank of ``group`` (default: the whole job; None and no process group: this
    process alone) writes its ``items`` (:class:`TensorShard` / :class:`ObjectShard`) to its
    own data file in ``path``; rank 0 then writes the metadata. Collective: every rank must
    call it, with items that together tile every tensor once. Returns the metadata on rank 0
    (None elsewhere). ``backend``: as for :func:`write_metadata`.

    Raises:
        DistCheckpointWriteError: on every rank, when the records do not form a checkpoint
            (the message is rank 0's).
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    global_rank = dist.get_rank() if distributed else 0
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    if distributed:
        dist.barrier(group)
    error = None
    try:
        with ShardWriter(path, global_rank) as writer:
            writer.add(items)
        records = writer.records
    except Exception as err:  # noqa: BLE001 - every rank learns that the save failed
        records, error = [], f"rank {global_rank}: {type(err).__name__}: {err}"
    if not distributed:
        if error:
            raise DistCheckpointWriteError(error)
        return write_metadata(path, records, backend)
    gathered = [None] * dist.get_world_size(group) if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object((records, error), gathered, dst=dst, group=group)
    outcome = [None]
    metadata = None
    if rank == 0:
        errors = [e for _, e in gathered if e]
        if not errors:
            try:
                metadata = write_metadata(path, [r for rs, _ in gathered for r in rs], backend)
            except DistCheckpointWriteError as err:
                errors.append(str(err))
        outcome = ["; ".join(errors) or None]
    dist.broadcast_object_list(outcome, src=dst, group=group)
    if outcome[0]:
        raise DistCheckpointWriteError(outcome[0])
    return metadata
