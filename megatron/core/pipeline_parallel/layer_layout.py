"""Which layers each (virtual) pipeline stage holds.

Four ways to say it, as in Megatron-LM:

* the default even split, or ``--decoder-first/last-pipeline-num-layers``
  (:func:`megatron.core.config.pipeline_layer_counts`);
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the
  embedding (first stage) and the loss (last stage) each take the place of one transformer layer
  when the layers are split evenly, e.g. 6 layers, pp 4, both flags: 8 places, 2 per stage, so
  the stages hold ``[1, 2, 2, 1]`` layers;
* ``--pipeline-model-parallel-layout``: every stage written out, e.g. ``"Et*3|(tt|)*6mL"``.
  ``E`` is the embedding, ``t`` a transformer layer, ``m`` a multi-token-prediction layer, ``L``
  the loss; ``|`` ends a stage; ``x*n`` repeats one character and ``(...)*n`` a group n times
  (groups do not nest); commas are only for the eye. There are ``pp * vp`` stages: stage ``i``
  is virtual stage ``i // pp`` of pipeline rank ``i % pp``, so with pp 2,
  ``"Et|tt|tt|tL"`` gives rank 0 ``[E t] [t t]`` and rank 1 ``[t t] [t L]`` (vp 2). The
  ``--mtp-num-layers`` MTP layers, one ``m`` each, stand in the last stage before ``L``, where
  they run, or, as Megatron's standalone MTP stage, in a stage of their own before the loss's
  (:func:`mtp_standalone_stage`; ``"Ettmm|L"``, ``"Et|ttmm|L"``, with virtual stages
  ``"Et|t|tmm|L"`` at pp 2: rank 0's second chunk; or further from the loss, the empty
  stages between passing its output on: ``"Ettmm||L"``, ``"Et|t|t|tmm||L"`` at pp 3);
* ``--standalone-embedding-stage``: pipeline rank 0 holds only the embedding, the other ranks
  the layers (:func:`standalone_embedding_layout` writes it as a layout).

Whatever the way, the layers are numbered in the order the stages run: virtual stage 0 of every
rank, then virtual stage 1, ... (see :func:`stage_layer_counts`).
"""

import re
from typing import List, Optional

from megatron.core.config import ConfigError, pipeline_layer_counts

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
_KINDS = {"E": "embedding", "t": "transformer layer", "m": "MTP layer", "L": "loss"}
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_CHAR = re.compile(r"(.)\*(\d+)")


def _fail(text: str, pos: int, why: str) -> None:
    raise ConfigError(f"{LAYOUT_FLAG} {text!r}: {why} at position {pos}")


def _expand(text: str, start: int = 0, stop: Optional[int] = None, whole: str = "") -> str:
    """``text[start:stop]`` with its repetitions written out and commas dropped; errors name
    their position in ``whole`` (the flag's value)."""
    whole = whole or text
    stop = len(text) if stop is None else stop
    out, pos = [], start
    while pos < stop:
        ch = text[pos]
        group = _GROUP.match(text, pos, stop) if ch == "(" else None
        single = _CHAR.match(text, pos, stop) if ch in _KINDS or ch == "|" else None
        if group:
            if not group.group(1):
                _fail(whole, pos, "empty group '()'")
            inner = _expand(text, group.start(1), group.end(1), whole)
            out.append(inner * int(group.group(2)))
            pos = group.end()
        elif single:
            out.append(single.group(1) * int(single.group(2)))
            pos = single.end()
        elif ch in _KINDS or ch == "|":
            out.append(ch)
            pos += 1
        elif ch == ",":
            pos += 1
        elif ch == "(":
            _fail(whole, pos, "'(' without a matching ')*n' (groups do not nest)")
        else:
            _fail(whole, pos, f"unexpected {ch!r} (characters: E t m L | , and repetitions "
                  "'x*n' or '(...)*n')")
    return "".join(out)


def parse_pipeline_layout(text: str) -> List[str]:
    """The stages of a layout string, in running order, each as a string of ``E t m L``."""
    if not text or not text.strip():
        raise ConfigError(f"{LAYOUT_FLAG} is empty")
    return _expand(text).split("|")


def layout_stage_counts(text: str, pp_size: int, num_layers: int,
                        mtp_num_layers: Optional[int] = None) -> List[List[int]]:
    """Transformer layers of each stage of a layout: ``counts[pp_rank][vp_rank]``.

    Checks what Megatron checks: the stages fill every pipeline rank equally, the embedding
    opens the first stage and the loss closes the last, once each, the ``t`` count is
    ``--num-layers`` and the MTP layers ``m`` stand where they run (:func:`check_mtp_letters`);
    given ``mtp_num_layers``, a layout with ``m`` letters must hold that many. The ``m``
    letters take no place in the numbering of the ``t`` layers.
    """
    stages = parse_pipeline_layout(text)
    if len(stages) % pp_size:
        raise ConfigError(f"{LAYOUT_FLAG} {text!r} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size ({pp_size})")
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: the embedding 'E' must appear once, first "
                          "in the first stage")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: the loss 'L' must appear once, last in the "
                          "last stage")
    if flat.count("t") != num_layers:
        raise ConfigError(f"{LAYOUT_FLAG} {text!r} holds {flat.count('t')} transformer layers "
                          f"('t'), but --num-layers is {num_layers}")
    if mtp_num_layers is not None or "m" in flat:
        check_mtp_letters(text, stages, pp_size, mtp_num_layers)
    vp_size = len(stages) // pp_size
    return [[stages[v * pp_size + p].count("t") for v in range(vp_size)]
            for p in range(pp_size)]


def check_mtp_letters(text: str, stages: List[str], pp_size: int,
                      mtp_num_layers: Optional[int]) -> None:
    """Megatron's rules for ``m``: one letter per MTP layer (``--mtp-num-layers`` of them),
    after every ``t``, all in one stage, the last virtual stage of its pipeline rank. That
    stage is the loss's (``...mmL``) or, Megatron's standalone MTP stage, one before it
    (``"Ettmm|L"``, ``"Et|ttmm|L"``, with virtual stages ``"Et|t|tmm|L"`` at pp 2) or further
    (``"Ettmm||L"``, ``"Et|t|t|tmm||L"`` at pp 3): the stages between are empty and hand its
    output on. As in Megatron, a run with MTP layers must place them: a layout without ``m``
    is refused."""
    flat = "".join(stages)
    count = flat.count("m")
    if mtp_num_layers is not None and count != mtp_num_layers:
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: the number of MTP layers ('m', {count}) "
                          f"must match --mtp-num-layers ({mtp_num_layers or 'not given'})")
    if count == 0:
        return
    if "t" in flat[flat.index("m"):]:
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: decoder layers ('t') must be placed before "
                          "the MTP layers ('m')")
    holding = [i for i, stage in enumerate(stages) if "m" in stage]
    vp_size = len(stages) // pp_size
    if any(i // pp_size != vp_size - 1 for i in holding):
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: the MTP layers ('m') must be in the last "
                          "virtual pipeline stage of their pipeline rank")
    if len(holding) > 1:
        raise ConfigError(f"{LAYOUT_FLAG} {text!r}: all of the MTP layers ('m') must be in the "
                          "same virtual pipeline stage")


def ranks_without_parameters(text: str, pp_size: int) -> List[int]:
    """The pipeline ranks all of whose stages are empty (``"Et||tL"`` at pp 3: rank 1): they
    would hold no parameter for an optimizer to train."""
    stages = parse_pipeline_layout(text)
    vp_size = len(stages) // pp_size
    return [r for r in range(pp_size)
            if not any(stages[v * pp_size + r] for v in range(vp_size))]


def mtp_standalone_stage(text: str) -> Optional[int]:
    """The stage (in running order) of a layout's MTP layers when it is not the loss's
    (Megatron's standalone MTP stage, ``--mtp-standalone``); None when they sit beside the
    loss or the layout has no ``m``."""
    stages = parse_pipeline_layout(text)
    holding = [i for i, stage in enumerate(stages) if "m" in stage]
    if not holding or holding[0] == len(stages) - 1:
        return None
    return holding[0]


def mtp_embedding_stages(text: Optional[str], pp_size: int, tied: bool) -> Optional[List[int]]:
    """The pipeline ranks whose word-embedding tables are kept in step when the layout has
    a standalone MTP stage: the first, the MTP stage's (its copy, to embed the shifted tokens)
    and, with tied embeddings, the last (the output layer); None: the usual first and last.
    E.g. pp 3, ``"Et|ttmm|L"``: ``[0, 1, 2]`` tied, ``[0, 1]`` untied; pp 2 with virtual
    stages, ``"Et|t|tmm|L"``: ``[0, 1]`` tied, ``[0]`` untied (rank 0 holds both the
    embedding and the MTP stage's copy, in its first and last chunks)."""
    rank = mtp_standalone_rank(text, pp_size)
    if rank is None:
        return None
    return sorted({0, rank} | ({pp_size - 1} if tied else set()))


def mtp_standalone_rank(text: Optional[str], pp_size: int) -> Optional[int]:
    """The pipeline rank of a layout's standalone MTP stage, or None. Stage ``i`` runs on
    rank ``i % pp`` (virtual stage ``i // pp``, the rank's last: the MTP layers must be
    there)."""
    stage = mtp_standalone_stage(text) if text and pp_size > 1 else None
    return None if stage is None else stage % pp_size


def is_mtp_standalone_stage(text: Optional[str], pp_size: int, pp_rank: int,
                            vp_rank: Optional[int]) -> bool:
    """Whether virtual stage ``vp_rank`` (None: no virtual stages) of pipeline rank
    ``pp_rank`` is the layout's standalone MTP stage."""
    stage = mtp_standalone_stage(text) if text and pp_size > 1 else None
    return stage is not None and stage == (vp_rank or 0) * pp_size + pp_rank


def accounted_stage_counts(num_layers: int, pp_size: int, vp_size: Optional[int] = None,
                           embedding: bool = False, loss: bool = False) -> List[List[int]]:
    """``counts[pp_rank][vp_rank]`` when the embedding and/or the loss count as one layer of
    the first / last stage (``--account-for-embedding/loss-in-pipeline-split``)."""
    vp = vp_size or 1
    places = num_layers + int(embedding) + int(loss)
    if places % (pp_size * vp):
        flags = [f for f, on in (("--account-for-embedding-in-pipeline-split", embedding),
                                 ("--account-for-loss-in-pipeline-split", loss)) if on]
        raise ConfigError(
            f"--num-layers ({num_layers}) plus one place each for {' and '.join(flags)} = "
            f"{places} is not divisible by --pipeline-model-parallel-size ({pp_size})"
            + (f" x virtual stages ({vp})" if vp > 1 else ""))
    per = places // (pp_size * vp)
    counts = [[per] * vp for _ in range(pp_size)]
    counts[0][0] -= int(embedding)
    counts[-1][-1] -= int(loss)
    if min(counts[0][0], counts[-1][-1]) < 0:
        raise ConfigError(f"--num-layers ({num_layers}) leaves no transformer layer for the "
                          "stage that holds the embedding or the loss")
    return counts


def standalone_embedding_layout(num_layers: int, pp_size: int,
                                vp_size: Optional[int] = None) -> str:
    """The layout of ``--standalone-embedding-stage``: pipeline rank 0 holds the input embedding
    and no transformer layer, the other ``pp - 1`` ranks share the layers evenly.

    With ``vp`` virtual stages, rank 0's first virtual stage is the embedding and its others
    are empty (they pass the hidden states on); each other rank's virtual stage holds
    ``L / ((pp - 1) vp)`` layers. E.g. 8 layers, pp 3: ``"E|t*4|t*4L"``; with vp 2:
    ``"E|t*2|t*2||t*2|t*2L"`` (rank 0 ``[E] []``, rank 1 ``[t t] [t t]``, rank 2 the same).
    """
    vp = vp_size or 1
    layer_stages = (pp_size - 1) * vp
    if pp_size < 2 or num_layers < 1 or num_layers % layer_stages:
        raise ConfigError(
            f"--standalone-embedding-stage: --num-layers ({num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size - 1 ({pp_size - 1}, the ranks after the "
            "embedding's)" + (f" x virtual stages ({vp})" if vp > 1 else ""))
    per = num_layers // layer_stages
    layers = "t" if per == 1 else f"t*{per}"
    stages = []
    for v in range(vp):
        stages += ["E" if v == 0 else ""] + [layers] * (pp_size - 1)
    stages[-1] += "L"
    return "|".join(stages)


def stage_layer_counts(num_layers: int, pp_size: int, vp_size: Optional[int] = None, *,
                       layout: Optional[str] = None, account_embedding: bool = False,
                       account_loss: bool = False, first: Optional[int] = None,
                       last: Optional[int] = None) -> List[List[int]]:
    """Transformer layers of every (virtual) stage, ``counts[pp_rank][vp_rank]``."""
    if layout is not None:
        return layout_stage_counts(layout, pp_size, num_layers)
    if account_embedding or account_loss:
        return accounted_stage_counts(num_layers, pp_size, vp_size, account_embedding,
                                      account_loss)
    per_rank = pipeline_layer_counts(num_layers, pp_size, first, last)
    vp = vp_size or 1
    for count in per_rank:
        if count % vp:
            raise ConfigError(
                f"--num-layers per pipeline stage ({count}) must be divisible by the number "
                f"of virtual stages ({vp}, from --num-layers-per-virtual-pipeline-stage)")
    return [[count // vp] * vp for count in per_rank]


def stage_offset(counts: List[List[int]], pp_rank: int, vp_rank: int = 0) -> int:
    """Global index of the first layer of ``(pp_rank, vp_rank)``: the layers of every stage
    that runs before it (all ranks' earlier virtual stages, then lower ranks' same one)."""
    before = sum(row[v] for row in counts for v in range(vp_rank))
    return before + sum(counts[p][vp_rank] for p in range(pp_rank))
