"""Megatron's supervised fine-tuning (``--sft``) dataset: conversations from JSONL files.

Each line of a ``--data-path`` file is a JSON object whose ``"messages"`` is a list of turns
``{"role": "system" | "user" | "assistant", "content": str}``. One line may hold several
conversations back to back: a ``system`` turn starts a new one. Every assistant turn follows a
user turn and is not empty. A bad line is refused naming the file and line.

Sample i of a split is its line ``i mod (lines in the split)`` (lines in file order, as Megatron's
SFT dataset takes them; the ``--split`` fractions cut the file's lines). Its conversations are
tokenized by the :class:`~megatron.tokenizer.sft_tokenizer.SFTTokenizer` and packed into one
sequence of ``--seq-length`` + 1 tokens:

* each conversation ends with the end-of-document token (appended unless it already ends so);
  its position ids start at 0;
* with context parallelism (``--context-parallel-size`` cp > 1) each conversation is followed
  by padding tokens up to a multiple of ``2 cp`` tokens (positions continuing its own), as
  Megatron pads them;
* a pack that reaches ``seq_length + 1`` tokens is cut to ``seq_length`` tokens plus one padding
  token, and the conversations after it are dropped;
* a shorter pack is filled with padding tokens, whose positions continue the last conversation's.

The sample is the pack shifted as usual: ``tokens = pack[:-1]``, ``labels = pack[1:]``. A label
carries loss (``loss_mask`` 1) only where it is an assistant token (past the format's assistant
header) or an appended end-of-document token, and is not the padding token. ``segment_ids`` number
the conversations of the pack (padding belongs to the last one): each conversation attends only
to itself, as Megatron's packed sequences (``cu_seqlens``) do.
"""

import json
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.data import dataset_utils
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import DataError

ROLES = ("system", "user", "assistant")


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of turns")
    for k, turn in enumerate(messages):
        if not (isinstance(turn, dict) and turn.get("role") in ROLES
                and isinstance(turn.get("content"), str)):
            raise DataError(f"{where}: turn {k} must be {{\"role\": one of {', '.join(ROLES)}, "
                            f"\"content\": a string}}, got {json.dumps(turn)[:120]}")
        if turn["role"] == "assistant":
            if not turn["content"]:
                raise DataError(f"{where}: turn {k} is an empty assistant turn")
            if k == 0 or messages[k - 1]["role"] != "user":
                raise DataError(f"{where}: assistant turn {k} does not follow a user turn")


def read_conversations_jsonl(path: str) -> List[list]:
    """The ``"messages"`` list of every line of ``path``; a bad line raises a
    :class:`DataError` naming the file and line (blank lines are skipped)."""
    return [messages for _, messages in _read_numbered(path)]


def _read_numbered(path: str) -> List[tuple]:
    """(line number, ``"messages"``) of every non-blank line of ``path``."""
    out = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"--data-path {path!r}: cannot open the SFT JSONL file ({e})") from None
    with f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict) or "messages" not in record:
                raise DataError(f"{where}: a line must be a JSON object with a \"messages\" key")
            _check_messages(record["messages"], where)
            out.append((number, record["messages"]))
    return out


def split_conversations(messages: Sequence[dict]) -> List[list]:
    """The conversations of one line: a system turn starts a new one."""
    out: List[list] = []
    for turn in messages:
        if turn["role"] == "system" or not out:
            out.append([])
        out[-1].append(turn)
    return out


def pack_conversations(conversations: Sequence[Sequence[dict]], tokenizer,
                       seq_length: int, pad_multiple: int = 1) -> Dict[str, np.ndarray]:
    """One packed sample (see the module docstring) of ``conversations``; ``pad_multiple``
    (``2 x --context-parallel-size`` with context parallelism) pads each conversation with
    padding tokens to a multiple of that many tokens, as Megatron does."""
    pad, eod, total = tokenizer.pad, tokenizer.eod, seq_length + 1
    tokens: List[int] = []
    trained: List[int] = []
    positions: List[int] = []
    segments: List[int] = []
    for number, conversation in enumerate(conversations):
        ids, mask = tokenizer.tokenize_conversation(conversation)
        ids, mask = ids.tolist(), mask.tolist()
        if not ids or ids[-1] != eod:
            ids.append(eod)
            mask.append(1)
        fill = (-(len(tokens) + len(ids))) % pad_multiple
        tokens += ids + [pad] * fill
        trained += mask + [0] * fill
        positions += range(len(ids) + fill)
        segments += [number] * (len(ids) + fill)
        if len(tokens) >= total:
            tokens, trained = tokens[:seq_length] + [pad], trained[:seq_length] + [0]
            positions, segments = positions[:total], segments[:total]
            break
    missing = total - len(tokens)
    if missing > 0:
        last = positions[-1] if positions else -1
        tokens += [pad] * missing
        trained += [0] * missing
        positions += range(last + 1, last + 1 + missing)
        segments += [segments[-1] if segments else 0] * missing
    labels = np.array(tokens[1:], dtype=np.int64)
    loss_mask = np.array(trained[1:], dtype=np.float32)
    loss_mask[labels == pad] = 0.0
    return {"tokens": np.array(tokens[:-1], dtype=np.int64), "labels": labels,
            "loss_mask": loss_mask, "position_ids": np.array(positions[:-1], dtype=np.int64),
            "segment_ids": np.array(segments[:-1], dtype=np.int64)}


def sft_attention_mask(segment_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The attention mask of a batch of packed samples, ``[b, 1, s, s]`` bool, True where a
    query may NOT see a key: causal within each conversation (``segment_ids`` ``[b, s]``), none
    across them. None (plain causal attention) when every sample holds one conversation."""
    if not bool((segment_ids != segment_ids[:, :1]).any()):
        return None
    s = segment_ids.shape[1]
    causal = torch.ones((s, s), dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)      # [b, s, s]
    return ~(same & causal).unsqueeze(1)                             # [b, 1, s, s]


class SFTDataset(torch.utils.data.Dataset):
    """``num_samples`` packed samples of one split of one JSONL file: ``lines`` are its
    (line number, messages) pairs."""

    def __init__(self, name: str, path: str, lines: Sequence[tuple], num_samples: int,
                 seq_length: int, tokenizer, pad_multiple: int = 1):
        if not lines:
            raise DataError(f"the {name} split of {path} holds no lines")
        self.name, self.path, self.lines = name, path, list(lines)
        self.num_samples, self.seq_length, self.tokenizer = int(num_samples), seq_length, tokenizer
        self.pad_multiple = pad_multiple

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for the {self.num_samples} samples of "
                             f"{self.name}")
        number, messages = self.lines[idx % len(self.lines)]
        try:
            return pack_conversations(split_conversations(messages), self.tokenizer,
                                      self.seq_length, self.pad_multiple)
        except ValueError as e:
            raise DataError(f"{self.path}:{number}: {e}") from None


def _split_datasets(path: str, split: Optional[str], num_samples: Sequence[int], seq_length,
                    tokenizer, only: Optional[int], pad_multiple: int
                    ) -> List[Optional[SFTDataset]]:
    lines = _read_numbered(path)
    if not lines:
        raise DataError(f"--data-path {path!r}: the SFT JSONL file holds no lines")
    bounds = ([None] * 3 if only is not None else dataset_utils.split_bounds(split, len(lines)))
    if only is not None:
        bounds[only] = (0, len(lines))
    out: List[Optional[SFTDataset]] = [None, None, None]
    for i, bound in enumerate(bounds):
        if bound is None or num_samples[i] <= 0:
            continue
        if bound[0] == bound[1]:
            if i == 0:
                raise DataError(f"--split {split!r} leaves the train split of {path!r} empty "
                                f"({len(lines)} lines); give train a larger share")
            continue
        out[i] = SFTDataset(dataset_utils.SPLIT_NAMES[i], path, lines[bound[0]:bound[1]],
                            num_samples[i], seq_length, tokenizer, pad_multiple)
    return out


def build_sft_datasets(data_path, num_samples: Sequence[int], seq_length: int, split: str,
                       tokenizer, per_split_paths: Sequence = (None, None, None),
                       context_parallel_size: int = 1) -> tuple:
    """The (train, valid, test) SFT datasets from ``--data-path`` (one JSONL file, or
    ``W1 FILE1 W2 FILE2 ...`` blended) cut by ``--split``, or from the per-split paths;
    ``context_parallel_size`` > 1 pads each conversation to a multiple of twice it."""
    num_samples = [int(n) for n in num_samples]
    pad_multiple = 2 * context_parallel_size if context_parallel_size > 1 else 1

    def build_blend(path, flag, only):
        files, weights = dataset_utils.parse_data_path(path, flag)
        if weights is None:
            return _split_datasets(files[0], split, num_samples, seq_length, tokenizer, only,
                                   pad_multiple)
        out: List = [None, None, None]
        normalized = dataset_utils.normalize_weights(weights)
        # A file's samples cycle through its lines, so each can serve any share of the blend.
        most = max(num_samples)
        parts = [_split_datasets(f, split, [most] * 3, seq_length, tokenizer, only,
                                 pad_multiple) for f in files]
        for i in range(3) if only is None else [only]:
            present = [(p[i], w) for p, w in zip(parts, normalized) if p[i] is not None and w > 0]
            if present and num_samples[i] > 0:
                out[i] = BlendableDataset([d for d, _ in present], [w for _, w in present],
                                          num_samples[i])
        return out

    return dataset_utils.build_splits(num_samples, data_path, per_split_paths, build_blend)
