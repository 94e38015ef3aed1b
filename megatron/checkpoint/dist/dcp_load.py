"""Safe replacements for the two unsafe parts of ``torch.distributed.checkpoint.load``.

``FileSystemReader.read_metadata`` (``pickle.load``) and ``DefaultLoadPlanner.load_bytes``
(``torch.load(weights_only=False)``) are replaced by the restricted unpickler of
:mod:`megatron.checkpoint.safe_unpickle`. Kept apart from :mod:`.reader` because subclassing
needs ``torch.distributed.checkpoint`` imported, which :mod:`.reader` defers to first use.
"""

import io
import os

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megatron.checkpoint.dist.reader import METADATA_FILE
from megatron.checkpoint.safe_unpickle import load_dcp_metadata, torch_load


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = load_dcp_metadata(os.path.join(str(self.path), name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose byte entries go through :func:`safe_unpickle.torch_load`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = torch_load(value.read(), f"byte entry {fqn!r}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
