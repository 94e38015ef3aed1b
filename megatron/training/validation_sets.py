"""The validation sets of a run: --full-validation and --multiple-validation-sets.

Without these flags a run has one validation iterator and each evaluation reads --eval-iters
global batches of it, going on where the previous evaluation stopped (Megatron's
``consumed_valid_samples``). With them the run's validation data is a :class:`ValidationSets`:

* ``--full-validation``: each evaluation reads every validation set once, from its start. A set
  of N samples is read in blocks of ``mbs x dp`` samples (evaluation's micro batch times the
  data-parallel size), each data-parallel rank taking its ``mbs`` of every block, as the
  training sampler does; the last ``N % (mbs x dp)`` samples, too few for a block, are left out
  (Megatron's sampler drops an incomplete last batch). The ``N // (mbs x dp)`` blocks are run as
  evaluation steps of the usual number of micro-batches (evaluation's global batch over
  ``mbs x dp``), the last step taking whatever blocks remain, so no block is read twice
  (:func:`full_pass_steps`). --eval-iters is not used for validation then (the test set still
  reads --eval-iters batches).
* ``--multiple-validation-sets``: each ``--valid-data-path`` prefix (given without weights) is its
  own set, evaluated and logged on its own as ``validation-INDEX`` (``validation-0``,
  ``validation-1``, ...), or ``validation-NAME`` with ``--validation-set-names``.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from megatron.data.dataset_utils import DataError


@dataclass
class ValidationSets:
    """What evaluation reads when --full-validation or --multiple-validation-sets is on.

    Attributes:
        suffixes: each set's suffix of ``validation`` in the log line and the scalar names
            (``""`` for a single set, ``"-0"`` or ``"-NAME"`` with several).
        iterators: each set's data iterator (None on tensor-parallel ranks other than 0, which
            receive their batches by broadcast; a list of one per model chunk with virtual
            pipeline stages).
        blocks: with --full-validation, each set's number of ``mbs x dp`` blocks (one pass);
            None: each evaluation reads --eval-iters batches.
    """

    suffixes: List[str]
    iterators: List = field(default_factory=list)
    blocks: Optional[List[int]] = None


def set_suffixes(count: int, multiple: bool, names: Sequence[str] = ()) -> List[str]:
    """``validation`` + suffix names each set: ``-NAME`` (--validation-set-names), else
    ``-INDEX`` with --multiple-validation-sets, else nothing (the one set)."""
    if not multiple:
        return [""]
    if names:
        return [f"-{name}" for name in names]
    return [f"-{index}" for index in range(count)]


def full_pass_steps(blocks: int, per_step: int) -> List[int]:
    """Micro-batches of each evaluation step of one pass over ``blocks`` blocks: steps of
    ``per_step`` micro-batches, then one step with the rest."""
    if per_step <= 0:
        raise ValueError(f"an evaluation step needs at least one micro-batch, got {per_step}")
    full, rest = divmod(int(blocks), int(per_step))
    return [per_step] * full + ([rest] if rest else [])


def count_blocks(datasets: Sequence, micro_batch_size: int, dp_size: int,
                 suffixes: Sequence[str]) -> List[int]:
    """Each validation set's ``mbs x dp`` blocks (0 for no data: nothing to evaluate); a set
    too small for one block is refused."""
    per_block = micro_batch_size * dp_size
    blocks = []
    for dataset, suffix in zip(datasets, suffixes):
        if dataset is None:
            blocks.append(0)
            continue
        size = len(dataset)
        if size < per_block:
            raise DataError(f"--full-validation: validation set 'validation{suffix}' has {size} "
                            f"samples, fewer than one evaluation micro batch "
                            f"({micro_batch_size}) x data-parallel size ({dp_size})")
        blocks.append(size // per_block)
    return blocks


def as_set_list(valid, count: int) -> list:
    """The valid datasets a provider returned (one, or a list with
    --multiple-validation-sets) as a list of ``count``; another count is refused."""
    datasets = list(valid) if isinstance(valid, (list, tuple)) else [valid]
    if len(datasets) != count:
        raise DataError(f"the dataset provider returned {len(datasets)} validation set(s); "
                        f"the flags (--multiple-validation-sets, --valid-data-path) ask for "
                        f"{count}")
    return datasets


def merge_chunks(per_chunk: Sequence[ValidationSets], pp_size: int) -> ValidationSets:
    """One :class:`ValidationSets` from one per virtual pipeline chunk: each set's iterator
    becomes the list of the chunks' iterators. The interleaved schedule runs a multiple of
    ``pp_size`` micro-batches, so with --full-validation each set's block count must be one
    (its last, shorter step included)."""
    first = per_chunk[0]
    for suffix, blocks in zip(first.suffixes, first.blocks or ()):
        if blocks % pp_size:
            raise DataError(f"--full-validation with virtual pipeline stages: validation set "
                            f"'validation{suffix}' makes {blocks} micro-batches, not a multiple "
                            f"of --pipeline-model-parallel-size ({pp_size}), which the "
                            f"interleaved schedule needs; change the micro batch or the data")
    iterators = [[sets.iterators[k] for sets in per_chunk] for k in range(len(first.suffixes))]
    return ValidationSets(first.suffixes, iterators, first.blocks)
