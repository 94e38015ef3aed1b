"""Teacher log-probabilities on disk, in Megatron-LM's cached-logits layout (format version 2).

A run with ``--logits-save-dir DIR`` writes, per data-parallel rank ``D`` and flush, one tar:

```
DIR/dp{D}__{start}-{end}.tar        the global train samples [start, end) of the flushed iterations
    _meta.json                      first member, compact JSON: {"hash", "identifiers", "saver":
                                    {"k", "p", "min_k", "save_dtype", "format_version": 2,
                                     "mbs_save", "dp_size_save", "gbs_save"}}
    {s}-{s + G}.pt.zst              one member per iteration (s: samples consumed before it,
                                    G: global batch): zstd (level 3) of a torch.save dict
```

The dict: ``values`` ``[seq, G / dp, K]`` in ``--logits-save-dtype`` (the log-probabilities of
the K most likely tokens, most likely first), ``indices_low`` ``[seq, G / dp, K]`` uint16 (their
ids' low 16 bits), ``bit_17`` uint8 ``[ceil(n / 8)]`` (the ids' 17th bit, ``numpy.packbits`` of
the flattened ``[seq, G / dp, K]`` array, most significant bit first), ``format_version`` 2.
Row ``r`` of rank ``D``'s member ``s`` is global sample ``s + ((r // M) * dp + D) * M + r % M``
(``M`` the micro-batch size): the pretraining sampler's order, micro-batch after micro-batch.
Entries dropped by the top-p cut, and the right padding of micro-batches cut narrower than the
iteration's widest, hold log-probability ``-1e3`` and id ``-1`` (stored as 131071). ``hash`` is
the MD5 of the compact JSON of ``identifiers``: ``{"seed", "train_samples", "blend"}``, the
fields that fix the global sample stream; a student run must produce the same one.

Megatron-LM also still reads its first layout (``format_version`` 1, absent from ``_meta.json``):
``[cp{C}_]dp{D}__{I}.tar`` named by the last iteration ``I`` it holds, members ``{i}.pt.zst``
named by iteration, ``values`` / ``indices_low`` lists of ``[seq, M, K]`` micro-batches and
``bit_17`` a list of bool tensors. It is read here too (never written).
"""

import hashlib
import io
import json
import os
import re
import tarfile
from collections import OrderedDict
from typing import List, Optional, Tuple

import numpy as np
import torch

FORMAT_VERSION = 2
META_MEMBER = "_meta.json"
MEMBER_SUFFIX = ".pt.zst"
SHARD_RE = re.compile(r"^dp(?P<dp>\d+)__(?P<start>\d+)-(?P<end>\d+)\.tar$")
MEMBER_RE = re.compile(r"^(?P<start>\d+)-(?P<end>\d+)\.pt\.zst$")
V1_SHARD_RE = re.compile(r"^(?:cp(?P<cp>\d+)_)?dp(?P<dp>\d+)__(?P<iter>\d+)\.tar$")
V1_MEMBER_RE = re.compile(r"^(?P<iter>\d+)\.pt\.zst$")
STALE_SUFFIX = ".stale"
ZSTD_LEVEL = 3
DROPPED_ID = -1
DROPPED_LOGPROB = -1e3          # Megatron-LM's sentinel log-probability
MAX_VOCAB = 2 ** 17             # ids are stored in 17 bits
SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class LogitsFileError(ValueError):
    """A teacher-logits file is missing, unreadable or does not fit this run; names the file."""


def zstd():
    """The ``zstandard`` module, imported on first use: only logits runs need it."""
    try:
        import zstandard
    except ImportError:
        raise LogitsFileError("--logits-save-dir / --logits-load-dir need the 'zstandard' "
                              "package (teacher logits are zstd-compressed): pip install "
                              "zstandard") from None
    return zstandard


def shard_name(dp_rank: int, start: int, end: int) -> str:
    return f"dp{dp_rank}__{start}-{end}.tar"


def member_name(start: int, end: int) -> str:
    return f"{start}-{end}{MEMBER_SUFFIX}"


def top_logprobs(logits: torch.Tensor, k: int, top_p: Optional[float] = None,
                 min_k: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """The K largest log-probabilities of ``logits`` ``[..., V]`` and their ids (fp32, int64).

    With ``top_p`` the entries after the smallest prefix whose probability reaches ``top_p``
    (at least ``min_k`` kept) become ``DROPPED_LOGPROB`` / ``DROPPED_ID``; the K dimension is
    cut to the most entries any position of ``logits`` keeps.
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


# ---- the dataset-identity hash -------------------------------------------------------------

def _blend_from_list(paths) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Megatron's reading of a ``--data-path``-style list: ``w1 p1 w2 p2 ...`` when it has an
    even length and every other entry is a number, else prefixes without weights."""
    if not paths:
        return None
    paths = [str(p) for p in paths]
    if len(paths) % 2 == 0:
        try:
            weights = [float(w) for w in paths[0::2]]
            return [p.strip() for p in paths[1::2]], weights
        except ValueError:
            pass
    return [p.strip() for p in paths], None


def _normalised(blend) -> Optional[list]:
    if blend is None:
        return None
    prefixes, weights = blend
    weights = weights if weights is not None else [1.0] * len(prefixes)
    return [[float(w), os.path.splitext(os.path.basename(p))[0]]
            for w, p in zip(weights, prefixes)]


def dataset_identifiers(args) -> "OrderedDict":
    """The fields that fix the global train sample stream, as Megatron-LM hashes them."""
    train_samples = args.train_samples
    if train_samples is None and args.train_iters is not None:
        train_samples = int(args.train_iters) * int(args.global_batch_size)
    if args.data_path:
        blend = {"kind": "blend", "blend": _normalised(_blend_from_list(args.data_path))}
    elif any((args.train_data_path, args.valid_data_path, args.test_data_path)):
        blend = {"kind": "blend_per_split",
                 "train": _normalised(_blend_from_list(args.train_data_path))}
    else:
        blend = {"kind": "mock", "mock": True}
    return OrderedDict([("seed", args.seed), ("train_samples", train_samples),
                        ("blend", blend)])


def dataset_hash(identifiers) -> str:
    text = json.dumps(identifiers, sort_keys=False, separators=(",", ":"))
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def meta_bytes(args, dp_size: int) -> bytes:
    """The ``_meta.json`` member every tar of this teacher run starts with."""
    identifiers = dataset_identifiers(args)
    meta = {"hash": dataset_hash(identifiers), "identifiers": identifiers,
            "saver": {"k": args.logits_save_top_k, "p": args.logits_save_top_p,
                      "min_k": args.logits_save_top_p_min_k,
                      "save_dtype": args.logits_save_dtype, "format_version": FORMAT_VERSION,
                      "mbs_save": args.micro_batch_size, "dp_size_save": dp_size,
                      "gbs_save": args.global_batch_size}}
    return json.dumps(meta, sort_keys=False, separators=(",", ":")).encode("utf-8")


# ---- one iteration's payload ---------------------------------------------------------------

def pack_ids(ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ids`` (17-bit, ``-1`` for dropped) as uint16 low bits and the packed 17th bits."""
    ids = ids.long().cpu()
    low = (ids & 0xFFFF).to(torch.uint16)
    high = ((ids >> 16) & 1).to(torch.uint8).reshape(-1).numpy()
    return low, torch.from_numpy(np.packbits(high))


def unpack_ids(low: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    bits = np.unpackbits(packed.numpy(), count=low.numel()).reshape(tuple(low.shape))
    return (torch.from_numpy(bits.astype(np.int64)) << 16) | low.long()


def encode_payload(values: torch.Tensor, ids: torch.Tensor) -> bytes:
    """One iteration's ``[seq, rows, K]`` log-probabilities and ids as a ``.pt.zst`` member."""
    low, high = pack_ids(ids)
    buffer = io.BytesIO()
    torch.save({"values": values.detach().cpu().contiguous(), "indices_low": low,
                "bit_17": high, "format_version": FORMAT_VERSION}, buffer)
    return zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(buffer.getvalue())


def decode_payload(data: bytes) -> Tuple[torch.Tensor, torch.Tensor]:
    """A member's ``(values [seq, rows, K], ids [seq, rows, K] int64)``, format 2 or 1 (whose
    micro-batch lists are joined along the rows, the order a format-2 member has)."""
    raw = zstd().ZstdDecompressor().decompressobj().decompress(data)
    payload = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if payload.get("format_version", 1) >= 2:
        values = payload["values"]
        return values, unpack_ids(payload["indices_low"], payload["bit_17"])
    ids = [(high.long() << 16) | low.long()
           for low, high in zip(payload["indices_low"], payload["bit_17"])]
    return torch.cat(list(payload["values"]), dim=1), torch.cat(ids, dim=1)


# ---- tars ----------------------------------------------------------------------------------

def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name=name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shard(root: str, dp_rank: int, members: List[Tuple[int, int, bytes]],
                meta: bytes) -> str:
    """Publish ``dp{dp_rank}__{start}-{end}.tar`` holding ``members`` (``(start, end, bytes)``
    in order) after ``_meta.json``; written to ``.tmp`` and renamed. A tar of the same rank
    whose samples it covers (left by a run resumed from an earlier checkpoint) is renamed
    ``.stale`` first, so no two live tars overlap."""
    start, end = members[0][0], members[-1][1]
    path = os.path.join(root, shard_name(dp_rank, start, end))
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w") as tar:
        _add_member(tar, META_MEMBER, meta)
        for first, last, data in members:
            _add_member(tar, member_name(first, last), data)
    for name in os.listdir(root):
        match = SHARD_RE.match(name)
        if (match and int(match["dp"]) == dp_rank and name != os.path.basename(path)
                and start <= int(match["start"]) and int(match["end"]) <= end):
            os.replace(os.path.join(root, name), os.path.join(root, name + STALE_SUFFIX))
    os.replace(tmp, path)
    return path
