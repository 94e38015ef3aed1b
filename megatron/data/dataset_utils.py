"""Helpers shared by the datasets: ``--split`` and ``--data-path`` parsing, sample counts, the
rank-0 index cache, and the left-to-right masks and position ids of a GPT batch."""

import hashlib
import json
import logging
import math
import os
import re
import time
import traceback
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")

# Samples built per blended dataset beyond its share, so the blend never runs one dry
# (``--mid-level-dataset-surplus``'s default).
BLEND_SURPLUS = 0.005


# ------------------------------------------------------------------------------- --split



class DataError(ValueError):
    """Data or data flags that cannot work; the message names the flag or file and the problem."""

def parse_split(split: str) -> List[float]:
    """``--split`` as three fractions summing to 1: "969, 30, 1", "80,20" (test gets 0), "1"."""
    text = str(split)
    if not re.fullmatch(r"[\s.,/0-9]*", text):
        raise DataError(f"--split must be up to three non-negative numbers separated by commas "
                         f"(e.g. 969,30,1); got {split!r}")
    try:
        parts = [float(p) for p in re.findall(r"[.0-9]+", text)]
    except ValueError:
        raise DataError(f"--split: cannot read the numbers in {split!r}") from None
    if not 1 <= len(parts) <= 3:
        raise DataError(f"--split takes 1 to 3 numbers (train, valid, test); got {split!r}")
    parts += [0.0] * (3 - len(parts))
    total = float(np.sum(np.array(parts, dtype=np.float64)))
    if total <= 0:
        raise DataError(f"--split must have a positive sum; got {split!r}")
    return (np.array(parts, dtype=np.float64) / total).tolist()


def split_bounds(split: str, num_sequences: int) -> List[Optional[Tuple[int, int]]]:
    """``[begin, end)`` sequence ids of the train, valid and test splits; FORMATS.md 3.1.

    The cumulative fractions b0=0, b1, b2, b3 are rounded separately: split i covers
    ``[round(b_i * N), round(b_{i+1} * N))``. A split whose fraction is 0 is None.
    """
    fractions = parse_split(split)
    bookends = [0.0]
    for f in fractions:
        bookends.append(bookends[-1] + f)
    bounds: List[Optional[Tuple[int, int]]] = []
    for i in range(3):
        lo, hi = bookends[i], bookends[i + 1]
        if hi <= lo:
            bounds.append(None)
        else:
            bounds.append((int(round(lo * float(num_sequences))),
                           int(round(hi * float(num_sequences)))))
    return bounds


# ------------------------------------------------------------------------------ --data-path


def check_has_documents(prefix: str, num_documents: int, flag: str) -> None:
    """Refuse a data file with no documents, naming it, before any split is cut from it (an
    empty file used to be reported as a --split that gives train too small a share)."""
    if num_documents == 0:
        raise DataError(f"{flag}: the data file {prefix}.bin/.idx holds no documents; "
                        "preprocess a non-empty input with tools/preprocess_data.py, or leave "
                        "this prefix out")


def parse_data_path(data_path: Union[str, Sequence[str], None],
                    flag: str = "--data-path") -> Tuple[List[str], Optional[List[float]]]:
    """``PREFIX`` or ``W1 PREFIX1 W2 PREFIX2 ...`` as (prefixes, weights or None).

    Weights are returned as given (not normalised). ``flag`` names the option in errors.
    """
    if data_path is None:
        raise DataError(f"{flag} is empty")
    items = [data_path] if isinstance(data_path, str) else [str(x) for x in data_path]
    items = [x.strip() for x in items]
    if len(items) == 0:
        raise DataError(f"{flag} is empty")
    if len(items) == 1:
        return items, None
    if len(items) % 2 == 1:
        raise DataError(f"{flag} takes one prefix or weight/prefix pairs (W1 PREFIX1 W2 PREFIX2 "
                         f"...); got {len(items)} entries: {items}")
    prefixes, weights = [], []
    for i in range(0, len(items), 2):
        try:
            weight = float(items[i])
        except ValueError:
            raise DataError(f"{flag}: entry {i + 1} should be the weight of {items[i + 1]!r}, "
                             f"got {items[i]!r} (expected W1 PREFIX1 W2 PREFIX2 ...)") from None
        if not weight >= 0 or math.isinf(weight):
            raise DataError(f"{flag}: weight of {items[i + 1]!r} must be >= 0, got {weight}")
        weights.append(weight)
        prefixes.append(items[i + 1])
    if sum(weights) <= 0:
        raise DataError(f"{flag}: the weights {weights} sum to 0")
    return prefixes, weights


def parse_prefix_list(data_path: Union[str, Sequence[str], None], flag: str) -> List[str]:
    """``PREFIX1 PREFIX2 ...`` without weights (``--multiple-validation-sets``: one validation
    set per prefix); a weighted list is refused, naming ``flag``."""
    if data_path is None or len(data_path) == 0:
        raise DataError(f"{flag} is empty")
    items = [data_path] if isinstance(data_path, str) else [str(x).strip() for x in data_path]
    for item in items:
        try:
            float(item)
        except ValueError:
            continue
        raise DataError(f"{flag} with --multiple-validation-sets takes prefixes without weights "
                        f"(one validation set each), got the number {item!r} in {items}")
    return items


def normalize_weights(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum in float64."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blend_num_samples(normalized_weights: Sequence[float], total: int,
                      surplus: float = BLEND_SURPLUS) -> List[int]:
    """Samples asked of each blended dataset: ``ceil(ceil(total * w) * (1 + surplus))``, with
    ``surplus`` from ``--mid-level-dataset-surplus`` (default 0.005); FORMATS.md 4."""
    return [int(math.ceil(math.ceil(total * w) * (1 + surplus))) for w in normalized_weights]


def check_blend_surplus(surplus: float) -> None:
    """Reject a ``--mid-level-dataset-surplus`` that is negative or not finite."""
    if not (math.isfinite(surplus) and surplus >= 0):
        raise DataError(f"--mid-level-dataset-surplus must be a finite number >= 0, got {surplus}")


def build_splits(num_samples: Sequence[int], data_path, per_split_paths: Sequence,
                 build_blend: Callable, missing_hint: str = "") -> tuple:
    """The (train, valid, test) datasets from ``--data-path``, or from the per-split paths.

    Args:
        num_samples: samples wanted per split.
        data_path: ``--data-path`` (split by ``--split``), or None.
        per_split_paths: ``--train-data-path``, ``--valid-data-path``, ``--test-data-path``
            values (each used whole for its split); exclusive with ``data_path``.
        build_blend: ``build_blend(path, flag, only)`` -> the three splits of ``path``
            (``only``: the one split index to build, None for all).
        missing_hint: appended to the error when no path is given (e.g. ``", or --mock-data"``).
    """
    if any(p for p in per_split_paths):
        if data_path:
            raise DataError("--data-path cannot be combined with --train-data-path, "
                            "--valid-data-path or --test-data-path")
        out: List = [None, None, None]
        flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
        for i, path in enumerate(per_split_paths):
            if path:
                out[i] = build_blend(path, flags[i], i)[i]
        return tuple(out)
    if not data_path:
        raise DataError(f"no data: pass --data-path (or --train-data-path ...){missing_hint}")
    return tuple(build_blend(data_path, "--data-path", None))


def get_train_valid_test_num_samples(train_iters: int, global_batch_size: int,
                                     eval_interval: int, eval_iters: int,
                                     train_samples: Optional[int] = None) -> List[int]:
    """Samples wanted per split; FORMATS.md 3.2 (``--train-samples`` overrides train)."""
    train = train_samples if train_samples else train_iters * global_batch_size
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    test = eval_iters * global_batch_size
    return [int(train), int(valid), int(test)]


# ------------------------------------------------------------------------------ index cache


def get_global_rank() -> int:
    """This process's rank in the default process group, or 0 without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def file_signature(path: str) -> Optional[List[int]]:
    """[size, mtime_ns] of a file, or None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [int(st.st_size), int(st.st_mtime_ns)]


def description_hash(description: dict) -> Tuple[str, str]:
    """(JSON text, md5 hex) of an index description; the hash names the cached files."""
    text = json.dumps(description, sort_keys=True, indent=2)
    return text, hashlib.md5(text.encode("utf-8")).hexdigest()


def cached_paths(cache_dir: str, kind: str, description: dict,
                 names: Sequence[str]) -> Dict[str, str]:
    """Where :func:`load_or_build_cached` keeps each named array."""
    digest = description_hash(description)[1]
    return {name: os.path.join(cache_dir, f"{digest}-{kind}-{name}.npy") for name in names}


def _atomic_write(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _error_marker_state(path: str):
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            return st.st_ino, st.st_mtime_ns, f.read()
    except FileNotFoundError:
        return None


def poll_sleep(seconds: float) -> None:
    """The pause between two looks at the cache folder (a function so tests can hook it)."""
    time.sleep(seconds)


def load_or_build_cached(cache_dir: str, kind: str, description: dict, names: Sequence[str],
                         build: Callable[[], Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Index arrays built once by global rank 0, saved as ``.npy`` and memory-mapped by all ranks.

    Files are ``{cache_dir}/{md5}-{kind}-{name}.npy`` where md5 hashes ``description`` (everything
    that determines the arrays). Rank 0 builds them when the completion marker ``{md5}-{kind}.done``
    is missing, writing each file under a temporary name and renaming it, the marker last. Other
    ranks poll for the marker (no collective, so a long build meets no timeout); if rank 0 fails it
    writes ``{md5}-{kind}.error`` and they raise with its message. An error marker already there
    when a rank starts waiting is left from an earlier run (rank 0 deletes it before building), so
    only a new or rewritten one counts. ``cache_dir`` must be one folder every rank sees (a shared
    file system across nodes).

    Returns:
        ``{name: read-only memory-mapped array}``.
    """
    text, digest = description_hash(description)
    base = os.path.join(cache_dir, f"{digest}-{kind}")
    paths = cached_paths(cache_dir, kind, description, names)
    done, error = base + ".done", base + ".error"

    def complete() -> bool:
        return os.path.exists(done) and all(os.path.exists(p) for p in paths.values())

    if get_global_rank() == 0:
        if not complete():
            _build_and_save(cache_dir, kind, base, text, paths, build)
    else:
        stale_error = _error_marker_state(error)
        announced = False
        interval = 0.01
        while not complete():
            state = _error_marker_state(error)
            if state is not None and state != stale_error:
                raise RuntimeError(f"global rank 0 failed to build the {kind} indices in "
                                   f"{cache_dir}; its error:\n"
                                   f"{state[2].decode('utf-8', 'replace')}")
            if not announced:
                logger.info("rank %d waiting for global rank 0 to build %s", get_global_rank(),
                            base + "-*.npy")
                announced = True
            poll_sleep(interval)
            interval = min(1.0, interval * 1.5)
    return {name: np.load(p, mmap_mode="r") for name, p in paths.items()}


def _build_and_save(cache_dir, kind, base, text, paths, build) -> None:
    done, error = base + ".done", base + ".error"
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as err:
        raise OSError(f"cannot create the index cache folder {cache_dir!r} ({err}); pass a "
                      f"writable folder with --data-cache-path") from err
    for stale in (error, done):
        try:
            os.remove(stale)
        except FileNotFoundError:
            pass
    start = time.time()
    try:
        arrays = build()
        try:
            for name, path in paths.items():
                _atomic_write(path, lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
            _atomic_write(base + "-description.json", lambda f: f.write(text.encode("utf-8")))
            _atomic_write(done, lambda f: f.write(b"ok\n"))
        except OSError as err:
            raise OSError(f"writing the {kind} indices to {cache_dir!r} failed ({err}); pass a "
                          f"writable folder with --data-cache-path") from err
    except BaseException as err:
        # Tell the waiting ranks; they would otherwise wait for a marker that never comes.
        message = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        try:
            _atomic_write(error, lambda f: f.write(message.encode("utf-8")))
        except OSError:
            pass
        raise
    logger.info("built the %s indices in %.2f s (%s)", kind, time.time() - start, cache_dir)


# ------------------------------------------------------------------------- masks of a batch


def _token_id(tokenizer, name: str) -> Optional[int]:
    try:
        value = getattr(tokenizer, name)
    except (AttributeError, NotImplementedError, KeyError, ValueError):
        return None
    return None if value is None else int(value)


def pad_token_id(tokenizer, allow_ambiguous_pad_tokens: bool = False) -> Optional[int]:
    """The id whose labels the GPT batch masks as padding, as Megatron-Core's datasets choose it:
    the tokenizer's pad id; None (nothing masked) when it has none, or when that id is also one
    of its other special tokens (its ``special_tokens_dict`` without ``pad_token``, else its eos
    and eod), unless ``--allow-ambiguous-pad-tokens`` keeps it anyway."""
    pad = _token_id(tokenizer, "pad")
    if pad is None:
        return None
    specials = getattr(tokenizer, "special_tokens_dict", None)
    if isinstance(specials, dict) and specials:
        others = [int(v) for k, v in specials.items() if k != "pad_token"]
    else:
        others = [i for i in (_token_id(tokenizer, "eos"), _token_id(tokenizer, "eod"))
                  if i is not None]
    if pad in others and not allow_ambiguous_pad_tokens:
        return None
    return pad


def mask_pad_tokens(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                    pad: Optional[int]) -> None:
    """In place, as Megatron-Core's GPT dataset: labels equal to ``pad`` get loss weight 0, and
    ``pad`` in tokens and labels becomes 0 (an id the embedding holds)."""
    if pad is None:
        return
    loss_mask[labels == pad] = 0.0
    tokens[tokens == pad] = 0
    labels[labels == pad] = 0


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention mask, loss mask and position ids of a left-to-right batch.

    Args:
        data: ``[b, s]`` token ids.
        eod_token: the end-of-document id.
        reset_position_ids: positions restart at 0 after every end-of-document token.
        reset_attention_mask: tokens after an end-of-document token cannot see tokens up to and
            including it (each document attends only within itself).
        eod_mask_loss: end-of-document tokens get loss weight 0.

    Returns:
        ``attention_mask`` bool ``[b, 1, s, s]`` (``[1, 1, s, s]`` unless
        ``reset_attention_mask``), True where attention is NOT allowed; ``loss_mask`` float
        ``[b, s]``; ``position_ids`` long ``[b, s]``.
    """
    b, s = data.shape
    dev = data.device
    is_eod = data == eod_token  # [b, s]
    causal = torch.ones((s, s), dtype=torch.bool, device=dev).tril()  # [s, s] True = allowed
    if reset_attention_mask:
        # segment[t]: end-of-document tokens strictly before t; a query sees a key only when no
        # end-of-document token lies in [key, query - 1], i.e. both have the same segment.
        segment = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()  # [b, s]
        same = segment.unsqueeze(2) == segment.unsqueeze(1)  # [b, s, s]
        allowed = (same & causal).unsqueeze(1)  # [b, 1, s, s]
    else:
        allowed = causal.view(1, 1, s, s)
    attention_mask = ~allowed

    loss_mask = torch.ones((b, s), dtype=torch.float, device=dev)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    positions = torch.arange(s, dtype=torch.long, device=dev)
    if reset_position_ids:
        # Position restarts at the token after each end-of-document token.
        after_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))  # [b, s]
        restart = torch.cummax(after_eod, dim=1).values  # [b, s]
        restart = torch.cat([torch.zeros((b, 1), dtype=torch.long, device=dev),
                             restart[:, :-1]], dim=1)
        position_ids = positions.unsqueeze(0) - restart
    else:
        position_ids = positions.unsqueeze(0).expand(b, s).contiguous()
    return attention_mask, loss_mask, position_ids
