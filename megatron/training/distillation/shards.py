"""Writing a teacher run's tars and finding a sample's teacher log-probabilities in them.

Samples are found by their position in the global train stream (the index the pretraining
sampler asked the dataset for): position ``g`` lives in the member of iteration ``g // G`` of
saved rank ``(x // M) % dp``, row ``(x // M) // dp * M + x % M`` (``x = g % G``; ``G``, ``M``,
``dp``: the teacher run's global batch, micro-batch size and data-parallel size). So a student
may use any data-parallel size, micro-batch or global batch size, and resume anywhere.
"""

import io
import json
import os
import tarfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.distillation import logits_files as lf
from megatron.training.distillation.logits_files import LogitsFileError


class TeacherWriter:
    """Collects one data-parallel rank's top-K of each train micro-batch and writes the
    iteration's member (its own tar) once the rank has its ``G / dp`` samples."""

    def __init__(self, root: str, meta: bytes, dp_rank: int, dp_size: int,
                 micro_batch_size: int, global_batch_size: int):
        self.root, self.meta, self.dp_rank, self.dp_size = root, meta, dp_rank, dp_size
        self.mbs, self.gbs = micro_batch_size, global_batch_size
        self.rows = global_batch_size // dp_size
        self._values: List[torch.Tensor] = []
        self._ids: List[torch.Tensor] = []
        self._start: Optional[int] = None
        os.makedirs(root, exist_ok=True)

    def add(self, values: torch.Tensor, ids: torch.Tensor, indices: List[int]) -> None:
        """One micro-batch: ``[b, s, K]`` log-probabilities (saved dtype) and ids of the samples
        at stream positions ``indices``."""
        done = sum(v.shape[0] for v in self._values)
        if done == 0:
            self._start = indices[0] - self.dp_rank * self.mbs
        expected = [self._position(done + j) for j in range(len(indices))]
        if indices != expected or self._start % self.gbs:
            raise LogitsFileError(
                f"--logits-save-dir {self.root}: data-parallel rank {self.dp_rank} got train "
                f"samples {indices}, expected {expected} (Megatron-LM's layout follows "
                "--dataloader-type single with a fixed global batch size)")
        self._values.append(values.detach().cpu())
        self._ids.append(ids.detach().cpu())
        if done + len(indices) == self.rows:
            self._flush()

    def _position(self, row: int) -> int:
        return self._start + ((row // self.mbs) * self.dp_size + self.dp_rank) * self.mbs \
            + row % self.mbs

    def _flush(self) -> None:
        width = max(v.shape[-1] for v in self._values)
        values = torch.cat([_pad(v, width, lf.DROPPED_LOGPROB) for v in self._values])
        ids = torch.cat([_pad(i, width, lf.DROPPED_ID) for i in self._ids])
        data = lf.encode_payload(values.transpose(0, 1), ids.transpose(0, 1))  # [s, rows, K]
        lf.write_shard(self.root, self.dp_rank,
                       [(self._start, self._start + self.gbs, data)], self.meta)
        self._values, self._ids = [], []


def _pad(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    extra = width - tensor.shape[-1]
    if extra == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, extra), value=value)


class ShardSet:
    """The tars of a ``--logits-load-dir``: where each sample's member is, read and checked."""

    def __init__(self, root: str, expected: Optional[Tuple[str, dict]]):
        """``expected``: this run's ``(dataset hash, identifiers)``, checked against every
        tar's ``_meta.json``; None skips the check."""
        self.root, self.expected = root, expected
        self._lock = threading.Lock()
        self._indexes: Dict[str, dict] = {}
        self.scan()
        first = self._first_path()
        saver = self._index(first)["meta"].get("saver", {})
        self.version = 2 if self.by_range else 1
        if self.version == 2:
            missing = [f for f in ("mbs_save", "dp_size_save", "gbs_save") if f not in saver]
            if missing:
                raise LogitsFileError(f"{first}: _meta.json has no {', '.join(missing)}")
            self.mbs, self.dp, self.gbs = (int(saver["mbs_save"]), int(saver["dp_size_save"]),
                                           int(saver["gbs_save"]))
        else:
            self.mbs, self.dp, self.gbs = self._v1_layout(first, saver)

    def scan(self) -> None:
        """List the tars, per saved rank, refusing overlapping ones and mixed layouts."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError as err:
            raise LogitsFileError(f"--logits-load-dir {self.root}: {err.strerror}") from None
        by_range: Dict[int, list] = {}
        by_iter: Dict[int, list] = {}
        for name in names:
            path = os.path.join(self.root, name)
            if (match := lf.SHARD_RE.match(name)) is not None:
                by_range.setdefault(int(match["dp"]), []).append(
                    (int(match["start"]), int(match["end"]), path))
            elif (match := lf.V1_SHARD_RE.match(name)) is not None:
                if match["cp"] not in (None, "0"):
                    raise LogitsFileError(f"{path}: saved by context-parallel rank "
                                          f"{match['cp']}; only cp0 tars hold whole sequences")
                by_iter.setdefault(int(match["dp"]), []).append((int(match["iter"]), path))
        if not by_range and not by_iter:
            raise LogitsFileError(f"--logits-load-dir {self.root}: no teacher logits tars "
                                  "(dp{D}__{start}-{end}.tar) there; a run with "
                                  "--logits-save-dir writes them")
        if by_range and by_iter:
            raise LogitsFileError(f"--logits-load-dir {self.root}: holds tars of both the "
                                  "sample-range and the older iteration-named layout")
        for tars in list(by_range.values()) + list(by_iter.values()):
            tars.sort()
        for tars in by_range.values():
            for (_, end, path), (start, _, later) in zip(tars, tars[1:]):
                if start < end:
                    raise LogitsFileError(f"{later} overlaps {path}: remove the stale one")
        self.by_range, self.by_iter = by_range, by_iter

    def _first_path(self) -> str:
        tars = self.by_range or self.by_iter
        return tars[min(tars)][0][-1]

    def _v1_layout(self, path: str, saver: dict) -> Tuple[int, int, int]:
        dp = int(saver.get("dp_size_save", max(self.by_iter) + 1))
        if "mbs_save" in saver and "gbs_save" in saver:
            return int(saver["mbs_save"]), dp, int(saver["gbs_save"])
        index = self._index(path)
        name = next(iter(index["members"]))
        payload = self._payload(path, name, raw=True)
        mbs = payload["values"][0].shape[1]
        return mbs, dp, len(payload["values"]) * mbs * dp

    def locate(self, position: int) -> Tuple[int, int, int]:
        """``(saved rank, first sample of its member, row)`` of stream position ``position``."""
        x = position % self.gbs
        start = position - x
        return (x // self.mbs) % self.dp, start, (x // self.mbs) // self.dp * self.mbs \
            + x % self.mbs

    def member(self, rank: int, start: int) -> Tuple[str, str]:
        """``(tar path, member name)`` holding rank ``rank``'s iteration starting at ``start``."""
        if self.version == 2:
            name = lf.member_name(start, start + self.gbs)
            for first, end, path in self.by_range.get(rank, []):
                if first <= start < end:
                    return path, name
        else:
            iteration = start // self.gbs
            name = f"{iteration}{lf.MEMBER_SUFFIX}"
            for last, path in self.by_iter.get(rank, []):
                if iteration <= last:
                    return path, name
        raise LogitsFileError(
            f"teacher logits of train samples [{start}, {start + self.gbs}) of saved "
            f"data-parallel rank {rank} are missing from --logits-load-dir {self.root} "
            f"(no tar holds {name})")

    def read(self, rank: int, start: int) -> Tuple[torch.Tensor, torch.Tensor, str]:
        """Rank ``rank``'s member at ``start``: values ``[s, rows, K]``, ids, and its name."""
        path, name = self.member(rank, start)
        if name not in self._index(path)["members"]:
            with self._lock:
                self.scan()   # a teacher still writing may have published it since
            path, name = self.member(rank, start)
        where = f"{path} member {name}"
        values, ids = self._payload(path, name)
        rows = self.gbs // self.dp
        if values.dim() != 3 or values.shape != ids.shape or values.shape[1] != rows:
            raise LogitsFileError(f"{where}: values of shape {tuple(values.shape)}, ids "
                                  f"{tuple(ids.shape)}, expected [seq, {rows}, K] both")
        return values, ids, where

    def _payload(self, path: str, name: str, raw: bool = False):
        index = self._index(path)
        if name not in index["members"]:
            raise LogitsFileError(f"{path}: no member {name} (teacher logits missing)")
        offset, size = index["members"][name]
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
            if raw:
                blob = lf.zstd().ZstdDecompressor().decompressobj().decompress(data)
                return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            return lf.decode_payload(data)
        except LogitsFileError:
            raise
        except Exception as err:  # the user's data, named with its path
            raise LogitsFileError(f"{path} member {name} is corrupt or not a teacher-logits "
                                  f"payload ({type(err).__name__}: {err})") from None

    def _index(self, path: str) -> dict:
        with self._lock:
            if path not in self._indexes:
                self._indexes[path] = self._read_index(path)
            return self._indexes[path]

    def _read_index(self, path: str) -> dict:
        """The tar's ``_meta.json`` (its dataset hash checked) and its members' byte ranges."""
        members, meta = {}, None
        try:
            with tarfile.open(path, "r:") as tar:
                for info in tar:
                    if not info.isreg():
                        continue
                    if info.name == lf.META_MEMBER:
                        meta = json.loads(tar.extractfile(info).read())
                    else:
                        members[info.name] = (info.offset_data, info.size)
        except (OSError, tarfile.TarError, ValueError) as err:
            raise LogitsFileError(f"{path} is not a readable teacher-logits tar "
                                  f"({type(err).__name__}: {err})") from None
        if meta is None:
            raise LogitsFileError(f"{path}: no {lf.META_MEMBER} member, so the data it holds "
                                  "cannot be checked against this run")
        if self.expected is not None and meta.get("hash") != self.expected[0]:
            raise LogitsFileError(
                f"{path} was saved with dataset hash {meta.get('hash')} "
                f"({meta.get('identifiers')}), this run has {self.expected[0]} "
                f"({dict(self.expected[1])}): the teacher's train samples are not this run's "
                "(same --seed, train samples and data blend needed)")
        return {"meta": meta, "members": members}


class TeacherReader:
    """Log-probabilities and ids of train samples by stream position: each member decoded once
    (``threads`` at a time), the next ``prefetch`` iterations of every member used read ahead,
    and members of positions already passed dropped."""

    def __init__(self, shards: ShardSet, seq_length: int, vocab_size: int, threads: int,
                 prefetch: int):
        self.shards, self.seq_length, self.vocab_size = shards, seq_length, vocab_size
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="teacher-logits")
        self.prefetch = prefetch
        self.pending: Dict[Tuple[int, int], object] = {}
        self._warned_trim = False

    def _future(self, key: Tuple[int, int]):
        if key not in self.pending:
            self.pending[key] = self.pool.submit(self.shards.read, *key)
        return self.pending[key]

    def get(self, positions: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities fp32 ``[b, s, K]`` and ids ``[b, s, K]`` (``-1`` dropped; K the
        widest sample's, narrower ones padded with dropped entries)."""
        located = [self.shards.locate(p) for p in positions]
        keys = sorted({(rank, start) for rank, start, _ in located})
        futures = {key: self._future(key) for key in keys}
        for rank, start in keys:
            for j in range(1, self.prefetch + 1):
                if self._exists(rank, start + j * self.shards.gbs):
                    self._future((rank, start + j * self.shards.gbs))
        self._forget_passed(min(start for _, start in keys))
        rows = []
        for rank, start, row in located:
            values, ids, where = futures[(rank, start)].result()
            rows.append(self._clean(values[:, row], ids[:, row], where))
        width = max(v.shape[-1] for v, _ in rows)
        return (torch.stack([_pad(v, width, lf.DROPPED_LOGPROB) for v, _ in rows]),
                torch.stack([_pad(i, width, lf.DROPPED_ID) for _, i in rows]))

    def _exists(self, rank: int, start: int) -> bool:
        try:
            self.shards.member(rank, start)
        except LogitsFileError:
            return False
        return True

    def _forget_passed(self, lowest: int) -> None:
        for key in [k for k in self.pending if k[1] < lowest]:
            self.pending.pop(key).cancel()

    def _clean(self, values: torch.Tensor, ids: torch.Tensor, where: str):
        """One sample's ``[s, K]``: trimmed to this run's sequence, dropped entries marked."""
        if values.shape[0] < self.seq_length:
            raise LogitsFileError(f"{where}: teacher sequences of {values.shape[0]} tokens, "
                                  f"this run's --seq-length is {self.seq_length}")
        if values.shape[0] > self.seq_length:
            if not self._warned_trim:
                self._warned_trim = True
                warnings.warn(f"{where}: teacher sequences of {values.shape[0]} tokens are "
                              f"trimmed to this run's {self.seq_length}", stacklevel=3)
            values, ids = values[:self.seq_length], ids[:self.seq_length]
        values = values.float()
        dropped = values <= lf.DROPPED_LOGPROB
        ids = torch.where(dropped, torch.full_like(ids, lf.DROPPED_ID), ids)
        kept = ids[~dropped]
        if kept.numel() and (int(kept.max()) >= self.vocab_size or int(kept.min()) < 0):
            raise LogitsFileError(f"{where}: token ids outside this run's padded vocabulary "
                                  f"[0, {self.vocab_size})")
        values = torch.where(dropped, torch.full_like(values, lf.DROPPED_LOGPROB), values)
        return values, ids
