"""Reading a ``torch_dist`` checkpoint folder safely, with or without a process group.

A folder holds ``.metadata`` (a pickled ``torch.distributed.checkpoint`` ``Metadata``: every
key's global shape, dtype and stored chunks, and where each chunk's bytes are), the data files
``__<rank>_<n>.distcp`` and ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``). Each
stored item is a ``torch.save``d object at ``(offset, length)`` of its data file: a tensor chunk,
or for a byte entry the bytes of ``torch.save([obj, ...])``.

:class:`DistCheckpointReader` reads the metadata with
:func:`megatron.checkpoint.safe_unpickle.load_dcp_metadata`, tensor chunks with
``torch.load(weights_only=True)`` (checked against the metadata's sizes and dtype) and byte entries
with :func:`megatron.checkpoint.safe_unpickle.torch_load`; nothing is unpickled any other way, so a
stranger's checkpoint cannot run code. Any slice of a global tensor can be read, whatever the
chunking it was written with: that is what resharding on load needs.

For ``torch.distributed.checkpoint.load`` itself, :class:`SafeFileSystemReader` and
:class:`SafeLoadPlanner` (in :mod:`.dcp_load`) replace the two places where torch's defaults
unpickle unsafely (``FileSystemReader.read_metadata``: ``pickle.load``;
``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``).
"""

import collections
import io
import json
import os
import pickle
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint.safe_unpickle import UnsafeCheckpointError, load_dcp_metadata, torch_load

METADATA_FILE = ".metadata"
BACKEND_FILE = "metadata.json"
BACKEND = "torch_dist"
# The run's common state: a byte entry, and (Megatron-Core releases up to 0.16) a file.
COMMON_STATE_FQN = "common_state/shard_0_1"
COMMON_FILE = "common.pt"

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


def _metadata_types():
    """``torch.distributed.checkpoint.metadata``, imported on first use: the package costs a
    process about 0.7 s of CPU, which a run that never reads a torch_dist folder need not pay."""
    from torch.distributed.checkpoint import metadata

    return metadata


class DistCheckpointError(RuntimeError):
    """A folder that is not a readable torch_dist checkpoint; the message names the file."""


def is_dist_checkpoint(path: str) -> bool:
    """Whether ``path`` is a torch_dist (or plain ``torch.distributed.checkpoint``) folder."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_backend(path: str) -> Optional[dict]:
    """``metadata.json`` of the folder (None when absent)."""
    file = os.path.join(path, BACKEND_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise DistCheckpointError(f"{file}: cannot be read ({err})") from None
    if not isinstance(config, dict):
        raise DistCheckpointError(f"{file}: holds {type(config).__name__}, expected an object")
    return config


def _overlap(a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int],
             b_size: Sequence[int]) -> Optional[Tuple[List[slice], List[slice]]]:
    """Slices of box a and of box b that cover their intersection (None if empty)."""
    in_a, in_b = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        in_a.append(slice(lo - ao, hi - ao))
        in_b.append(slice(lo - bo, hi - bo))
    return in_a, in_b


class DistCheckpointReader:
    """One torch_dist iteration folder, read without a process group.

    Args:
        path: the iteration folder (``iter_0000010``).
        cache_bytes: decoded tensor chunks kept for reuse (several TP slices of one chunk read
            it once); 0 turns the cache off.

    Raises:
        DistCheckpointError: no ``.metadata``, another sharded backend, unreadable metadata.
        UnsafeCheckpointError: the metadata names a class outside DCP's own records.
    """

    def __init__(self, path: str, cache_bytes: int = 256 << 20):
        self.path = path
        meta_path = os.path.join(path, METADATA_FILE)
        if not os.path.isfile(meta_path):
            raise DistCheckpointError(f"{path}: no {METADATA_FILE}; not a torch_dist checkpoint")
        backend = read_backend(path)
        if backend is not None and backend.get("sharded_backend", BACKEND) != BACKEND:
            raise DistCheckpointError(
                f"{os.path.join(path, BACKEND_FILE)}: sharded_backend "
                f"{backend.get('sharded_backend')!r}; only {BACKEND!r} can be read")
        self.backend = backend
        try:
            self.metadata: "Metadata" = load_dcp_metadata(meta_path)
        except UnsafeCheckpointError:
            raise
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError,
                TypeError) as err:
            raise DistCheckpointError(f"{meta_path}: cannot be read ({err})") from None
        self._storage = self.metadata.storage_data or {}
        self._use_fused_norm_names()
        self._cache: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()
        self._cache_limit = cache_bytes
        self._cached = 0

    def _use_fused_norm_names(self) -> None:
        """List unfused layer-norm tensors (``decoder.layers.input_layernorm.weight``,
        ``...pre_mlp_layernorm.bias``) under the fused names every other spelling of the file
        uses (:func:`~megatron.checkpoint.dist.keys.fused_norm_aliases`), so callers ask for
        one name whichever ``--transformer-impl`` spec wrote the file."""
        import dataclasses

        from megatron.checkpoint.dist.keys import fused_norm_aliases

        aliases = fused_norm_aliases(self.tensor_keys())
        if not aliases:
            return
        renamed = {saved: fused for fused, saved in aliases.items()}
        entries = self.metadata.state_dict_metadata
        self.metadata.state_dict_metadata = {renamed.get(k, k): v for k, v in entries.items()}
        self._storage = {(dataclasses.replace(index, fqn=renamed[index.fqn])
                          if index.fqn in renamed else index): info
                         for index, info in self._storage.items()}
        self.metadata.storage_data = self._storage

    # -- what the checkpoint holds ---------------------------------------------------------

    def tensor_keys(self) -> List[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, _metadata_types().TensorStorageMetadata)]

    def byte_keys(self) -> List[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, _metadata_types().BytesStorageMetadata)]

    def __contains__(self, key: str) -> bool:
        return key in self.metadata.state_dict_metadata

    def _tensor_meta(self, key: str) -> "TensorStorageMetadata":
        meta = self.metadata.state_dict_metadata.get(key)
        if not isinstance(meta, _metadata_types().TensorStorageMetadata):
            what = "a byte entry" if meta is not None else "absent"
            raise DistCheckpointError(f"{self.path}: tensor {key!r} is {what}")
        return meta

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._tensor_meta(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor_meta(key).properties.dtype

    def chunks(self, key: str) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """``(offsets, sizes)`` of every stored chunk of ``key``."""
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self._tensor_meta(key).chunks]

    def chunk_file(self, key: str, offsets: Sequence[int]) -> str:
        """The data file (relative to the folder) that holds the chunk of ``key`` at
        ``offsets``: which rank wrote it."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._storage.get(MetadataIndex(key, torch.Size(tuple(offsets))))
        if info is None:
            raise DistCheckpointError(f"{self.path}: no stored chunk of {key!r} at "
                                      f"{list(offsets)}")
        return info.relative_path

    def summary(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """``{key: (global shape, dtype)}`` of every tensor."""
        return {k: (self.shape(k), self.dtype(k)) for k in self.tensor_keys()}

    # -- raw items -------------------------------------------------------------------------

    def _item_bytes(self, index, what: str) -> bytes:
        info = self._storage.get(index)
        if info is None:
            raise DistCheckpointError(f"{self.path}: {what} is listed but has no storage entry")
        if getattr(info, "transform_descriptors", None):
            raise DistCheckpointError(f"{self.path}: {what} is stored with transforms "
                                      f"{list(info.transform_descriptors)}, which this reader "
                                      "does not support")
        file = os.path.join(self.path, info.relative_path)
        if os.path.dirname(os.path.normpath(info.relative_path)) not in ("", "."):
            raise DistCheckpointError(f"{self.path}: {what} points outside the folder "
                                      f"({info.relative_path!r})")
        try:
            with open(file, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as err:
            raise DistCheckpointError(f"{file}: cannot be read ({err.strerror})") from None
        if len(data) != info.length:
            raise DistCheckpointError(f"{file}: truncated ({what} needs bytes {info.offset}.."
                                      f"{info.offset + info.length}, the file ends before)")
        return data

    def _chunk(self, key: str, offsets: Tuple[int, ...], sizes: Tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
        cache_key = (key, offsets)
        if cache_key in self._cache:
            self._cache.move_to_end(cache_key)
            return self._cache[cache_key]
        from torch.distributed.checkpoint.metadata import MetadataIndex

        what = f"chunk {list(offsets)} of {key!r}"
        index = MetadataIndex(key, torch.Size(offsets))
        data = self._item_bytes(index, what)
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure is reported with the item
            first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            file = os.path.join(self.path, self._storage[index].relative_path)
            raise DistCheckpointError(f"{file}: {what} cannot be read ({first})") from None
        if (not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(sizes)
                or tensor.dtype != dtype):
            got = (f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor)
                   else type(tensor).__name__)
            raise DistCheckpointError(f"{self.path}: {what} holds {got}, the metadata says "
                                      f"{tuple(sizes)} {dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self._cache_limit:
            self._cache[cache_key] = tensor
            self._cached += nbytes
            while self._cached > self._cache_limit:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.numel() * old.element_size()
        return tensor

    def clear_cache(self) -> None:
        self._cache.clear()
        self._cached = 0

    # -- reading ---------------------------------------------------------------------------

    def read(self, key: str, offset: Optional[Sequence[int]] = None,
             size: Optional[Sequence[int]] = None, out: Optional[torch.Tensor] = None,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The slice ``[offset, offset + size)`` of global tensor ``key`` (all of it by
        default), assembled from whatever chunks overlap it, in the stored dtype (or
        ``dtype``), written into ``out`` when given (its shape must be ``size``).

        Raises:
            DistCheckpointError: an unknown key, a slice outside the tensor, a part of the slice
                that no chunk covers, or a chunk whose bytes do not match the metadata.
        """
        meta = self._tensor_meta(key)
        shape = tuple(meta.size)
        offset = tuple(offset) if offset is not None else (0,) * len(shape)
        size = tuple(size) if size is not None else tuple(s - o for s, o in zip(shape, offset))
        if len(offset) != len(shape) or len(size) != len(shape) or any(
                o < 0 or z < 0 or o + z > s for o, z, s in zip(offset, size, shape)):
            raise DistCheckpointError(f"{self.path}: slice at {list(offset)} of size "
                                      f"{list(size)} is outside {key!r} of shape {list(shape)}")
        stored = meta.properties.dtype
        if out is None:
            out = torch.empty(size, dtype=dtype or stored)
        elif tuple(out.shape) != size:
            raise DistCheckpointError(f"{key!r}: the target has shape {tuple(out.shape)}, the "
                                      f"slice {list(size)}")
        covered = 0
        for chunk in meta.chunks:
            both = _overlap(offset, size, tuple(chunk.offsets), tuple(chunk.sizes))
            if both is None:
                continue
            in_out, in_chunk = both
            piece = self._chunk(key, tuple(chunk.offsets), tuple(chunk.sizes), stored)
            out[tuple(in_out)].copy_(piece[tuple(in_chunk)])
            covered += int(torch.Size([s.stop - s.start for s in in_out]).numel())
        if covered != int(torch.Size(size).numel()):
            raise DistCheckpointError(f"{self.path}: the stored chunks of {key!r} do not cover "
                                      f"the slice at {list(offset)} of size {list(size)} exactly "
                                      f"({covered} of {torch.Size(size).numel()} elements)")
        return out

    def read_object(self, key: str) -> Any:
        """A byte entry, unpickled by :func:`megatron.checkpoint.safe_unpickle.torch_load`.
        Megatron-Core stores each as ``torch.save([obj])``; this returns the stored list as it is.

        Raises:
            UnsafeCheckpointError: the entry names a global outside the allow-list (its code
                never runs).
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex

        meta = self.metadata.state_dict_metadata.get(key)
        if not isinstance(meta, _metadata_types().BytesStorageMetadata):
            what = "a tensor" if meta is not None else "absent"
            raise DistCheckpointError(f"{self.path}: byte entry {key!r} is {what}")
        data = self._item_bytes(MetadataIndex(key), f"byte entry {key!r}")
        return torch_load(data, f"{self.path}: byte entry {key!r}")

    def read_single_object(self, key: str) -> Any:
        """A byte entry holding one object (``[obj]``): the object."""
        value = self.read_object(key)
        if not isinstance(value, list) or len(value) != 1:
            raise DistCheckpointError(f"{self.path}: byte entry {key!r} holds "
                                      f"{type(value).__name__}, expected a one-element list")
        return value[0]

    def common_state(self) -> dict:
        """The run's common state (``common_state/shard_0_1``, or the ``common.pt`` that
        Megatron-Core releases up to 0.16 write instead): ``args``, ``iteration``,
        ``checkpoint_version``, ``opt_param_scheduler``, ``optimizer`` param groups, ..."""
        key = COMMON_STATE_FQN
        file = os.path.join(self.path, COMMON_FILE)
        if key in self:
            state, where = self.read_single_object(key), key
        elif os.path.isfile(file):
            with open(file, "rb") as f:
                state, where = torch_load(f.read(), file), COMMON_FILE
        else:
            raise DistCheckpointError(f"{self.path}: no {key} and no {COMMON_FILE}; not a "
                                      "Megatron-Core checkpoint")
        if not isinstance(state, dict):
            raise DistCheckpointError(f"{self.path}: {where} holds {type(state).__name__}, "
                                      "expected a dict")
        return state
