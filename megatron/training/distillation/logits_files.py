"""Teacher log-probabilities on disk: one file per training sample, named by its sample index.

Layout written by a run with ``--logits-save-dir DIR`` (this project's own format, version 1):

```
DIR/logits_meta.json                    {"format": "megatron-teacher-logits", "format_version": 1,
                                         "top_k", "top_p", "top_p_min_k", "dtype",
                                         "seq_length", "vocab_size"}
DIR/{i // 1000:07d}/{i:012d}.pt         sample i of the train dataset
```

``i`` is the sample's index in the train dataset (the index the data loader asked the dataset
for), so a file belongs to a sample whatever the data-parallel size, micro-batch size or
resume point of the run that reads it. Each sample file is a ``torch.save`` dict, read back
with ``weights_only=True``:

- ``sample_index`` (int), ``format_version`` (int, 1);
- ``logprobs`` ``[s, K]`` in the saved dtype: the teacher's log-probabilities (log-softmax over
  the padded vocabulary) of its K most likely tokens at each position, most likely first;
- ``token_ids`` ``[s, K]`` int32: their vocabulary ids; ``-1`` marks an entry dropped by the
  top-p cut (its log-probability is ``-1e4``).

Megatron-LM writes the same quantities (top-K log-probabilities, sentinel ``-1`` ids after the
top-p cut) as zstd-compressed tar shards per data-parallel rank and flush; that container is not
read or written here.
"""

import json
import os
from typing import Optional, Tuple

import torch

FORMAT_NAME = "megatron-teacher-logits"
FORMAT_VERSION = 1
META_FILE = "logits_meta.json"
DROPPED_ID = -1
DROPPED_LOGPROB = -1e4
SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class LogitsFileError(ValueError):
    """A teacher-logits file is missing, unreadable or does not fit this run; names the file."""


def sample_path(root: str, sample_index: int) -> str:
    """Where sample ``sample_index``'s teacher log-probabilities live under ``root``."""
    return os.path.join(root, f"{sample_index // 1000:07d}", f"{sample_index:012d}.pt")


def top_logprobs(logits: torch.Tensor, k: int, top_p: Optional[float] = None,
                 min_k: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """The K largest log-probabilities of ``logits`` ``[..., V]`` and their ids (fp32, int64).

    With ``top_p`` the entries after the smallest prefix whose probability reaches ``top_p``
    (at least ``min_k`` kept) become ``DROPPED_LOGPROB`` / ``DROPPED_ID``; the K dimension is
    cut to the most entries any position keeps.
    """
    logits = logits.float()
    k = min(k, logits.shape[-1])
    values, ids = torch.topk(logits, k, dim=-1)                            # [..., K]
    values = values - torch.logsumexp(logits, dim=-1, keepdim=True)
    if top_p is None:
        return values, ids
    probs = values.exp()
    before = probs.cumsum(dim=-1) - probs                 # mass of the entries ranked above
    keep = (before < top_p) | (torch.arange(k, device=values.device) < min(min_k, k))
    width = int(keep.sum(dim=-1).max().item())
    keep = keep[..., :width]
    values = torch.where(keep, values[..., :width], torch.full_like(values[..., :width],
                                                                    DROPPED_LOGPROB))
    ids = torch.where(keep, ids[..., :width], torch.full_like(ids[..., :width], DROPPED_ID))
    return values, ids


def write_meta(root: str, meta: dict) -> None:
    """Write ``DIR/logits_meta.json``, or check that the one there describes the same run."""
    path = os.path.join(root, META_FILE)
    meta = dict(meta, format=FORMAT_NAME, format_version=FORMAT_VERSION)
    if os.path.exists(path):
        old = read_meta(root)
        if old != meta:
            raise LogitsFileError(f"--logits-save-dir {root}: {path} was written with {old}, "
                                  f"this run saves {meta}; use an empty folder")
        return
    os.makedirs(root, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_meta(root: str) -> dict:
    """``DIR/logits_meta.json`` as a dict; a clear error when it is missing or not ours."""
    path = os.path.join(root, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise LogitsFileError(f"--logits-load-dir {root}: no {META_FILE} there (a run with "
                              f"--logits-save-dir writes it)") from None
    except (OSError, ValueError) as err:
        raise LogitsFileError(f"{path}: not readable as JSON ({err})") from None
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise LogitsFileError(f"{path}: format {meta.get('format')!r} version "
                              f"{meta.get('format_version')!r}, expected {FORMAT_NAME!r} "
                              f"version {FORMAT_VERSION}")
    return meta


def write_sample(root: str, sample_index: int, logprobs: torch.Tensor,
                 token_ids: torch.Tensor) -> None:
    """Write one sample's ``[s, K]`` log-probabilities and ids (to a temporary name, then
    renamed, so a reader never sees half a file; a rerun of the sample replaces it)."""
    path = sample_path(root, sample_index)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"format_version": FORMAT_VERSION, "sample_index": int(sample_index),
                "logprobs": logprobs.detach().cpu().contiguous(),
                "token_ids": token_ids.detach().to(torch.int32).cpu().contiguous()}, tmp)
    os.replace(tmp, path)


def read_sample(root: str, sample_index: int, seq_length: int,
                vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sample ``sample_index``'s (log-probabilities fp32 ``[s, K]``, ids int64 ``[s, K]``).

    Raises:
        LogitsFileError: naming the file, when it is missing, unreadable, for another sample,
            or its shapes or ids do not fit ``seq_length`` / ``vocab_size``.
    """
    path = sample_path(root, sample_index)
    if not os.path.exists(path):
        raise LogitsFileError(f"teacher logits file {path} for train sample {sample_index} "
                              f"is missing (--logits-load-dir {root})")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        logprobs, ids = data["logprobs"], data["token_ids"]
        index = data["sample_index"]
    except Exception as err:  # any unreadable file is the user's data, named with its path
        raise LogitsFileError(f"teacher logits file {path} is corrupt or not a teacher-logits "
                              f"file ({type(err).__name__}: {err})") from None
    _check_sample(path, sample_index, index, logprobs, ids, seq_length, vocab_size)
    return logprobs.float(), ids.long()


def _check_sample(path, sample_index, index, logprobs, ids, seq_length, vocab_size) -> None:
    if index != sample_index:
        raise LogitsFileError(f"teacher logits file {path} holds sample {index}, expected "
                              f"{sample_index}")
    if (not isinstance(logprobs, torch.Tensor) or not isinstance(ids, torch.Tensor)
            or logprobs.dim() != 2 or logprobs.shape != ids.shape
            or logprobs.shape[0] != seq_length):
        shape = getattr(logprobs, "shape", None)
        raise LogitsFileError(f"teacher logits file {path}: log-probabilities of shape "
                              f"{shape}, expected [{seq_length}, K] with ids of the same shape")
    if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < DROPPED_ID):
        raise LogitsFileError(f"teacher logits file {path}: token ids outside "
                              f"[0, {vocab_size}) (and {DROPPED_ID} for dropped entries)")
