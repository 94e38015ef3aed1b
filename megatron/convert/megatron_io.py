"""Megatron-layout checkpoints of any TP / PP to and from the canonical stream of
:mod:`megatron.convert.schema`.

:func:`load_megatron` reads ``iter_XXXXXXX/mp_rank_*/model_optim_rng.pt`` files saved under any
tensor-parallel size, any pipeline split (even, uneven first / last stages, or interleaved virtual
stages saved as ``model0``, ``model1``, ...) and yields whole tensors a layer at a time.
:func:`save_megatron` (:mod:`megatron.convert.megatron_save`) writes the stream as a checkpoint at
a target TP x PP (even split, no virtual stages) with the keys and nesting
``GPTModel.state_dict_for_save_checkpoint`` (or ``BertModel``'s) produces. A checkpoint whose last
stage has ``lm_head`` is a BERT: its token-type table, pooler, LM head and binary head travel as
well (the pooler and binary head only when present, i.e. without ``--bert-no-binary-head``).
Shared rules and the file reader are in :mod:`megatron.convert.megatron_layout`.

How tensors are split over TP ranks (``megatron/core/tensor_parallel/layers.py``):

====================================  ===========================================================
word embeddings, output layer         rows, contiguous (vocab-parallel / column-parallel)
query_key_value weight and bias       rows, contiguous; each rank holds whole query groups
dense weight                          columns (row-parallel); its bias is replicated
dense_h_to_4h weight and bias         rows; with SwiGLU stride 2: rank r holds [gate_r; value_r]
dense_4h_to_h weight                  columns (row-parallel); its bias is replicated
MLA linear_q_proj, linear_q_up_proj,  rows, contiguous (whole heads per rank)
  linear_kv_up_proj weights
MLA linear_proj weight                columns (row-parallel)
MLA down projections, router, expert  replicated
  bias
norms, position embeddings            replicated (rank 0's copy is read)
BERT lm_head.bias                     rows, contiguous, like the word embeddings (padding too)
other BERT tensors                    replicated (token-type table, pooler, lm_head dense and
                                      layernorm, binary head)
====================================  ===========================================================

The optimizer and RNG states are dropped: they belong to parameters as sharded at the source and
cannot be resharded exactly. Every file written carries ``"conversion": {"from_layout": [tp, pp]
(None for a source that is not a Megatron checkpoint), "optimizer": "dropped", "rng":
"dropped"}``. The LR / weight-decay schedule (``opt_param_scheduler``) is layout-free and is kept:
the loader passes it in ``meta.source_args[SCHEDULER_KEY]``, the saver writes it back.

Memory. Source files are opened with ``torch.load(mmap=True)`` once per piece and closed again,
so only the pages of the piece being read are mapped. Target files are first written whole with
``torch.serialization.skip_data`` (shapes and metadata; the tensor bytes are left as space to fill
and never allocated), then every piece of the stream is copied into them through a shared
``mmap`` opened for that piece and one file alone (target shards are views of the piece, except
SwiGLU's stride-2 ``dense_h_to_4h`` and vocabulary rows added as padding). Resident at most: the
largest piece (the embedding table, or one transformer layer) about twice -- joined in memory,
plus either its source pages or one target file's pages mapped. Nothing grows with the number of
layers, and no temporary files are written.
"""

import argparse
import os
import re
import sys
import types
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint import optimizer_state
from megatron.model.module import flatten_state_dict
from megatron.checkpoint.config import torch_format_expert_tp_error
from megatron.checkpoint.layout import (TRACKER_FILENAME, CheckpointError, checkpoint_dir_name,
                                        checkpoint_file, read_tracker, saved_sizes)
from megatron.checkpoint.names import lookup_dotted
from megatron.checkpoint.saved_args import megatron_args
from megatron.checkpoint.router_bias import is_router_bias, note_zero_router_bias_once
from megatron.convert.megatron_layout import (  # noqa: F401  (re-exported: the public rules)
    BERT_HEAD_KEYS, SCHEDULER_KEY, TOKENTYPE_KEYS, get_path, has_prefix, join_shards,
    layer_tensor_names, layer_tensor_shapes, mtp_split_rule, mtp_tensor_shapes, read_rank_file,
    split_tensor, tp_split_rule)
from megatron.convert.megatron_save import save_megatron  # noqa: F401  (re-exported)
from megatron.convert.schema import (BERT_VOCAB_TENSOR, ConversionError, ModelMeta, Piece,
                                     bert_head_shapes)


def _encoder(language_model: dict, path: str) -> dict:
    """The layers' dict (``encoder``; ``transformer`` in older Megatron files)."""
    encoder = language_model.get("encoder", language_model.get("transformer"))
    if not isinstance(encoder, dict):
        raise ConversionError(f"{path}: no language_model.encoder in the saved model state")
    return encoder


class _Source:
    """Where every tensor of a Megatron checkpoint lives: files, chunks, local layer numbers."""

    def __init__(self, load_dir: str, ckpt_step: Optional[int], view: Optional[str] = None):
        self.view = view
        self._view_cache: Tuple[Optional[tuple], Optional[optimizer_state.SourceOptimizer]] = \
            (None, None)
        tracked = read_tracker(load_dir) if os.path.isdir(load_dir) else None
        if tracked is None:
            raise ConversionError(f"--load-dir {load_dir}: no {TRACKER_FILENAME}; "
                                  "not a Megatron checkpoint folder")
        self.iteration, self.release = tracked
        if ckpt_step is not None:
            self.iteration, self.release = ckpt_step, False
        self.load_dir = load_dir
        iter_dir = os.path.join(load_dir, checkpoint_dir_name(
            self.iteration, self.release))
        if not os.path.isdir(iter_dir):
            raise ConversionError(f"{iter_dir}: missing (named by "
                                  f"{TRACKER_FILENAME} or --ckpt-step)")
        try:
            self.tp, self.pp, self.ep = saved_sizes(iter_dir)
        except CheckpointError as err:
            raise ConversionError(str(err)) from None
        for tp_rank, pp_rank, ep_rank in self.ranks():
            path = self.file(tp_rank, pp_rank, ep_rank)
            if not os.path.isfile(path):
                raise ConversionError(f"{path}: missing; {iter_dir} holds TP {self.tp} x PP "
                                      f"{self.pp} x EP {self.ep} rank folders, so every one "
                                      "is needed")
        first = read_rank_file(self.file(0, 0))
        self.args = first.get("args")
        if not isinstance(self.args, argparse.Namespace):
            raise ConversionError(f"{self.file(0, 0)}: holds no args namespace")
        self.scheduler = first.get("opt_param_scheduler")
        chunks = sorted(int(k[5:]) for k in first if re.fullmatch(r"model\d+", k))
        if "model" not in first and not chunks:
            raise ConversionError(f"{self.file(0, 0)}: no model state ('model' or 'model0')")
        self.vp = None if "model" in first else len(chunks)
        _refuse_grouped_experts(first[self.chunk_key(0)], self.file(0, 0))
        self._check_args_layout(iter_dir)
        self.layer_map = self._layer_map()
        self._find_bert(first[self.chunk_key(0)])
        del first
        self.optimizer, self.optimizer_note = self._read_optimizers()

    def ranks(self) -> List[Tuple[int, int, int]]:
        """``(tp_rank, pp_rank, ep_rank)`` of every source file."""
        return [(t, p, e) for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    def expert_file(self, name: str) -> Tuple[int, str]:
        """``(ep_rank, local name)`` of a layer tensor named with its global expert number
        (``mlp.experts.local_experts.<J>...``); ``(0, name)`` for a dense one."""
        from megatron.checkpoint.experts import local_expert, renumber

        expert = local_expert(name)
        if expert is None or self.ep == 1:
            return 0, name
        per_rank = self.args.num_experts // self.ep
        return expert // per_rank, renumber(name, expert % per_rank)

    def _chunks_of(self, state: dict) -> List[dict]:
        return [state[self.chunk_key(c)] for c in range(self.vp or 1)]

    def _read_optimizers(self) -> Tuple[Optional[dict], str]:
        """What every target needs of the source's optimizer state (``ModelMeta.optimizer``),
        or None and why it cannot be carried (then it is dropped, as before)."""
        steps, hparams, has_main, scaler = set(), {}, set(), None
        for rank in self.ranks():
            state = read_rank_file(self.file(*rank))
            found, why = optimizer_state.SourceOptimizer.read(state, self._chunks_of(state),
                                                              self.file(*rank))
            if found is None:
                return None, f"{self.file(*rank)}: {why}"
            steps.add(found.step)
            has_main.add(found.has_main)
            for key, values in found.hparams.items():
                hparams.setdefault(key, values)
            scaler = scaler or found.grad_scaler
        if len(steps) != 1:
            return None, f"its ranks have taken different numbers of steps ({sorted(steps)})"
        if steps == {0}:
            return None, "its optimizer has not taken a step (no Adam state yet)"
        return {"step": steps.pop(), "hparams": hparams, "has_main": has_main == {True},
                "grad_scaler": scaler}, ""

    def _chunk_tree(self, tp_rank: int, pp_rank: int, chunk: int,
                    ep_rank: int = 0) -> Tuple[dict, str]:
        """One chunk's model tree of a rank file, or its view (:mod:`optimizer_state`)."""
        path = self.file(tp_rank, pp_rank, ep_rank)
        state = read_rank_file(path)
        tree = state.get(self.chunk_key(chunk))
        if self.view is None or tree is None:
            return tree, path
        if self._view_cache[0] != (tp_rank, pp_rank, ep_rank):
            found, why = optimizer_state.SourceOptimizer.read(state, self._chunks_of(state),
                                                              path)
            if found is None:
                raise ConversionError(f"{path}: {why}")
            self._view_cache = ((tp_rank, pp_rank, ep_rank), found)
        return optimizer_state.view_tree(tree, chunk, self._view_cache[1].entries,
                                         self.view), path

    def _find_bert(self, first_model: dict) -> None:
        """BERT or GPT (a BERT's last stage has ``lm_head``), and the BERT parts present."""
        last_model = read_rank_file(self.file(0, self.pp - 1))[self.chunk_key((self.vp or 1) - 1)]
        self.bert = has_prefix(last_model, "lm_head")
        self.binary_head = self.bert and lookup_dotted(last_model, "binary_head.weight") is not None
        tokentypes = lookup_dotted(first_model, ".".join(TOKENTYPE_KEYS)) if self.bert else None
        self.num_tokentypes = 0 if tokentypes is None else tokentypes.size(0)

    def file(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
        return checkpoint_file(self.load_dir, self.iteration, tp_rank, pp_rank,
                                             self.pp, self.release, ep_rank, self.ep)

    def chunk_key(self, chunk: int) -> str:
        return "model" if self.vp is None else f"model{chunk}"

    def mtp_stage(self) -> Tuple[int, int]:
        """``(pp_rank, chunk)`` of the stage holding the final norm and the MTP layers: the
        last one, or a layout's standalone MTP stage (``--mtp-standalone``)."""
        from megatron.core.pipeline_parallel.layer_layout import mtp_standalone_stage

        layout = getattr(self.args, "pipeline_model_parallel_layout", None)
        index = mtp_standalone_stage(layout) if layout and self.pp > 1 else None
        if index is None:
            return self.pp - 1, (self.vp or 1) - 1
        return index % self.pp, index // self.pp

    def _check_args_layout(self, iter_dir: str) -> None:
        saved = (getattr(self.args, "tensor_model_parallel_size", self.tp),
                 getattr(self.args, "pipeline_model_parallel_size", self.pp),
                 getattr(self.args, "expert_model_parallel_size", self.ep) or 1)
        if saved != (self.tp, self.pp, self.ep):
            raise ConversionError(
                f"{iter_dir}: the rank folders say TP {self.tp} x PP {self.pp} x EP {self.ep} "
                f"but the saved args say TP {saved[0]} x PP {saved[1]} x EP {saved[2]}; the "
                "checkpoint is incomplete or mixed")
        etp = getattr(self.args, "expert_tensor_parallel_size", None)
        if getattr(self.args, "num_experts", None) and etp not in (None, self.tp):
            # Expert pieces are joined over the TP files below; other splits have no files.
            raise ConversionError(torch_format_expert_tp_error(
                self.tp, etp, f"{iter_dir}: a --ckpt-format torch checkpoint saved at",
                "its expert tensors cannot be told apart; convert a --ckpt-format torch_dist "
                "checkpoint of the run instead"))

    def _layer_map(self) -> List[Tuple[int, int, int]]:
        """``(pp_rank, chunk, local index)`` of every global layer."""
        from megatron.core.config import ConfigError
        from megatron.model.transformer import get_num_layers_and_offset

        layout = types.SimpleNamespace(
            num_layers=self.args.num_layers,
            first_pipeline_num_layers=getattr(self.args, "decoder_first_pipeline_num_layers",
                                              None),
            last_pipeline_num_layers=getattr(self.args, "decoder_last_pipeline_num_layers",
                                             None),
            pipeline_model_parallel_layout=getattr(self.args, "pipeline_model_parallel_layout",
                                                   None),
            account_for_embedding_in_pipeline_split=getattr(
                self.args, "account_for_embedding_in_pipeline_split", False),
            account_for_loss_in_pipeline_split=getattr(
                self.args, "account_for_loss_in_pipeline_split", False))
        where = {}
        try:
            for pp_rank in range(self.pp):
                for chunk in range(self.vp or 1):
                    count, offset = get_num_layers_and_offset(
                        layout, self.pp, pp_rank, self.vp, chunk if self.vp else None)
                    for local in range(count):
                        where[offset + local] = (pp_rank, chunk, local)
        except ConfigError as err:
            raise ConversionError(f"{self.file(0, 0)}: the saved pipeline split cannot be "
                                  f"reproduced: {err}") from None
        if sorted(where) != list(range(self.args.num_layers)):
            raise ConversionError(f"{self.file(0, 0)}: the saved pipeline split does not cover "
                                  f"--num-layers {self.args.num_layers}")
        return [where[i] for i in range(self.args.num_layers)]

    def _language_model(self, tp_rank: int, pp_rank: int, chunk: int,
                        ep_rank: int = 0) -> Tuple[dict, str]:
        tree, path = self._chunk_tree(tp_rank, pp_rank, chunk, ep_rank)
        return get_path({"model": tree}, ["model", "language_model"], path), path

    def read_tp(self, pp_rank: int, chunk: int, keys: Sequence[str], join_dim: Optional[int],
                stride: int = 1) -> torch.Tensor:
        """One tensor under ``language_model`` (``keys[0] == "encoder"``: under the encoder):
        the TP shards joined along ``join_dim``, or rank 0's copy when None."""
        shards = []
        for tp_rank in range(self.tp) if join_dim is not None else [0]:
            language_model, path = self._language_model(tp_rank, pp_rank, chunk)
            if keys[0] == "encoder":
                shards.append(get_path(_encoder(language_model, path), keys[1:], path))
            else:
                shards.append(get_path(language_model, keys, path))
        if join_dim is None:
            return shards[0].clone()
        return join_shards(shards, join_dim, stride)

    def read_model(self, pp_rank: int, chunk: int, dotted: str,
                   join_dim: Optional[int]) -> torch.Tensor:
        """One tensor at dotted key ``dotted`` of the model tree, any nesting: the TP shards
        joined along ``join_dim``, or rank 0's copy when None."""
        shards = []
        for tp_rank in range(self.tp) if join_dim is not None else [0]:
            tree, path = self._chunk_tree(tp_rank, pp_rank, chunk)
            tensor = lookup_dotted(tree, dotted)
            if not isinstance(tensor, torch.Tensor):
                raise ConversionError(f"{path}: no {dotted} in the saved model state")
            shards.append(tensor)
        return shards[0].clone() if join_dim is None else join_shards(shards, join_dim)

    def read_layer(self, index: int, names: Sequence[str], swiglu: bool) -> Dict[str, torch.Tensor]:
        """All tensors of global layer ``index``, joined; the files are opened once per rank."""
        pp_rank, chunk, local = self.layer_map[index]
        per_rank = []
        for tp_rank in range(self.tp):
            tensors = {}
            by_file: Dict[int, List[Tuple[str, str]]] = {}
            for name in names:
                ep_rank, saved_name = self.expert_file(name)
                by_file.setdefault(ep_rank, []).append((name, saved_name))
            for ep_rank, pairs in sorted(by_file.items()):
                language_model, path = self._language_model(tp_rank, pp_rank, chunk, ep_rank)
                encoder = _encoder(language_model, path)
                for name, saved_name in pairs:
                    tensors[name] = _layer_tensor(encoder, f"layers.{local}.{saved_name}", path,
                                                  getattr(self.args, "q_lora_rank", None))
            per_rank.append(tensors)
        out = {}
        for name in names:
            rule = tp_split_rule(name, swiglu)
            if rule is None:
                out[name] = per_rank[0][name].clone()
            else:
                out[name] = join_shards([shards[name] for shards in per_rank], *rule)
        return out


    def read_mtp(self, depth: int, names: Sequence[str], swiglu: bool) -> Dict[str, torch.Tensor]:
        """All tensors of multi-token prediction depth ``depth`` (under ``mtp`` of the last
        stage's last chunk, or of a standalone MTP stage), joined over TP; experts from their
        expert rank's file."""
        last, chunk = self.mtp_stage()
        per_rank = []
        for tp_rank in range(self.tp):
            tensors, trees = {}, {}
            for name in names:
                ep_rank, saved_name = self.expert_file(name)
                if ep_rank not in trees:
                    trees[ep_rank] = self._chunk_tree(tp_rank, last, chunk, ep_rank)
                tree, path = trees[ep_rank]
                tensors[name] = _layer_tensor(get_path({"model": tree}, ["model", "mtp"], path),
                                              f"layers.{depth}.{saved_name}", path,
                                              getattr(self.args, "q_lora_rank", None))
            per_rank.append(tensors)
        out = {}
        for name in names:
            rule = mtp_split_rule(name, swiglu)
            out[name] = (per_rank[0][name].clone() if rule is None else
                         join_shards([shards[name] for shards in per_rank], *rule))
        return out


def _refuse_grouped_experts(tree: dict, path: str) -> None:
    """Experts saved in Megatron-Core's grouped-linear layout (--moe-single-grouped-weight /
    -bias) are read from torch_dist files, whose keys are per expert, not from torch ones."""
    for name in flatten_state_dict(tree):
        if re.search(r"\.mlp\.experts\.linear_fc[12]\.(weight|bias)\d*$", name):
            raise ConversionError(
                f"{path}: {name} is in Megatron-Core's grouped-linear expert layout "
                "(--moe-single-grouped-weight / --moe-single-grouped-bias), which the converter "
                "reads from --ckpt-format torch_dist files only (resume the run with "
                "--ckpt-format torch_dist and convert that)")


_FUSED_DOWN = "self_attention.linear_qkv_down_proj.weight"
_SPLIT_DOWN = {"self_attention.linear_q_down_proj.weight": 0,
               "self_attention.linear_kv_down_proj.weight": 1}


def _layer_tensor(tree: dict, key: str, path: str,
                  q_lora_rank: Optional[int] = None) -> torch.Tensor:
    """``tree[key]``; a router bias an older checkpoint lacks reads as zeros, the router of
    those versions (:mod:`megatron.checkpoint.router_bias`); an MLA down projection of a
    ``--mla-down-proj-fusion`` run is its rows of ``linear_qkv_down_proj`` (split at
    ``q_lora_rank``)."""
    part = next((i for name, i in _SPLIT_DOWN.items() if key.endswith(name)), None)
    if key not in tree and part is not None and q_lora_rank is not None:
        fused_key = key[:key.rindex("self_attention.")] + _FUSED_DOWN
        if fused_key in tree:
            fused = get_path(tree, [fused_key], path)
            return fused[:q_lora_rank] if part == 0 else fused[q_lora_rank:]
    if key not in tree and is_router_bias(key):
        weight = get_path(tree, [key[:-len("bias")] + "weight"], path)
        note_zero_router_bias_once(path, key)
        return torch.zeros(weight.shape[0], dtype=weight.dtype)
    return get_path(tree, [key], path)


def _params_dtype(args) -> torch.dtype:
    dtype = getattr(args, "params_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.bfloat16 if getattr(args, "bf16", False) else torch.float32


def _true_vocab_size(args, padded: int, override: Optional[int], where: str) -> int:
    """The tokenizer's size: ``override`` (--true-vocab-size), else from the tokenizer the saved
    args name; when that cannot be built, every row of the padded table is kept."""
    if override is not None:
        size = override
    else:
        from megatron.tokenizer import build_tokenizer

        try:
            quiet = argparse.Namespace(**{**vars(megatron_args(args)), "rank": 1,
                                          "padded_vocab_size": padded})
            size = build_tokenizer(quiet).vocab_size
        except Exception as err:  # noqa: BLE001 - any tokenizer failure: fall back, say why
            print(f"NOTE: cannot build the tokenizer {where} names "
                  f"({type(err).__name__}: {str(err)[:160]}), so its true vocabulary size is "
                  f"unknown; keeping all {padded} rows of the embedding table (pass "
                  "--true-vocab-size to re-pad exactly)", file=sys.stderr, flush=True)
            return padded
    if not 0 < size <= padded:
        raise ConversionError(f"--true-vocab-size {size} must be between 1 and the saved padded "
                              f"vocabulary size ({padded}) of {where}")
    return size


def _abspath(path: Optional[str]) -> Optional[str]:
    return os.path.abspath(path) if path else None


def _moe_layer_freq(args, where: str):
    """The saved ``--moe-layer-freq`` in Megatron's form (an int, or a list of 0/1 per layer;
    a string of the list form is read as the flag is)."""
    from megatron.model.moe.config import parse_moe_layer_freq

    freq = getattr(args, "moe_layer_freq", 1)
    if freq is None:
        return 1
    if isinstance(freq, str):
        try:
            freq = parse_moe_layer_freq(freq)
        except ValueError as err:
            raise ConversionError(f"{where}: {err}") from None
    if isinstance(freq, int):
        if freq < 1:
            raise ConversionError(f"{where}: --moe-layer-freq {freq}: must be >= 1")
        return freq
    freq = [int(v) for v in freq]
    if len(freq) != args.num_layers or any(v not in (0, 1) for v in freq):
        raise ConversionError(f"{where}: --moe-layer-freq {freq}: expected one 0 or 1 per "
                              f"layer (--num-layers {args.num_layers})")
    return freq


def _moe_fields(args, where: str) -> dict:
    """``ModelMeta``'s mixture-of-experts fields from saved args."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return {}
    balancing = getattr(args, "moe_router_load_balancing_type", None) or ()
    if "quantile_balancing" in ([balancing] if isinstance(balancing, str) else balancing):
        raise ConversionError(f"{where}: a --moe-router-load-balancing-type quantile_balancing "
                              "checkpoint routes by its mlp.router.qb_beta, which the converter "
                              "does not carry (no Hugging Face model has it): not built")
    for flag in ("moe_latent_size", "moe_mlp_glu_interleave_size",
                 "moe_shared_expert_glu_interleave_size"):
        if getattr(args, flag, None) is not None:
            raise ConversionError(f"{where}: a --{flag.replace('_', '-')} checkpoint is not "
                                  "converted (its layout is not carried): not built")
    return dict(num_experts=experts, moe_layer_freq=_moe_layer_freq(args, where),
                moe_router_topk=getattr(args, "moe_router_topk", 2),
                moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
                moe_router_score_function=getattr(args, "moe_router_score_function",
                                                  "softmax") or "softmax",
                moe_router_pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
                moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor",
                                                       None),
                moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
                moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
                moe_router_enable_expert_bias=bool(getattr(
                    args, "moe_router_enable_expert_bias", False)),
                moe_shared_expert_intermediate_size=getattr(
                    args, "moe_shared_expert_intermediate_size", None) or None,
                moe_shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)))


def _attention_fields(args, where: str) -> dict:
    """``ModelMeta``'s window and softmax fields from saved args (a Megatron-LM file may hold
    the skip pattern as a list)."""
    from megatron.core.config import SOFTMAX_TYPES, ConfigError, check_window_settings

    window = getattr(args, "window_size", None)
    freq = getattr(args, "window_attn_skip_freq", None)
    window = tuple(int(v) for v in window) if window is not None else None
    if freq is not None and not isinstance(freq, int):
        freq = tuple(int(v) for v in freq)
    softmax_type = getattr(args, "softmax_type", None) or "vanilla"
    try:
        check_window_settings(window, freq, args.num_layers)
    except ConfigError as err:
        raise ConversionError(f"{where}: {err}") from None
    if softmax_type not in SOFTMAX_TYPES:
        raise ConversionError(f"{where}: --softmax-type {softmax_type!r}: expected one of "
                              f"{', '.join(SOFTMAX_TYPES)}")
    return dict(window_size=window, window_attn_skip_freq=freq, softmax_type=softmax_type)


def _meta_from_args(src: _Source, true_vocab_size: Optional[int]) -> ModelMeta:
    args = src.args
    for flag in ("qk_l2_norm", "attention_output_gate", "no_rope_freq",
                 "experimental_attention_variant"):
        if getattr(args, flag, None):
            raise ConversionError(f"{src.file(0, 0)}: --{flag.replace('_', '-')}: this "
                                  "attention variant has no converter target (load the "
                                  "checkpoint with the training's own --ckpt-format)")
    if getattr(args, "heterogeneous_layers_config_encoded_json", None):
        raise ConversionError(f"{src.file(0, 0)}: --heterogeneous-layers-config-path: the "
                              "converter does not know per-layer shapes yet (load the "
                              "checkpoint with the training's own --ckpt-format)")
    if getattr(args, "mtp_use_repeated_layer", False):
        raise ConversionError(f"{src.file(0, 0)}: --mtp-use-repeated-layer: one MTP layer "
                              "(mtp.layers.0) shared by every depth has no converter target "
                              "(load the checkpoint with the training's own --ckpt-format)")
    heads = args.num_attention_heads
    gqa = getattr(args, "group_query_attention", False)
    position = getattr(args, "position_embedding_type", "learned_absolute")
    if getattr(args, "use_rotary_position_embeddings", False):
        position = "rope"
    if getattr(args, "multi_latent_attention", False) and position in ("rope", "yarn"):
        # What the training runs (megatron.training.configs): --rope-type, YaRN when unset.
        position = getattr(args, "rope_type", None) or "yarn"
    epsilon = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", None)
    padded = args.padded_vocab_size
    # In this project's conventions, without Megatron's own classes (the target writes them).
    source_args = dict(vars(megatron_args(args)))
    if src.scheduler is not None:
        source_args[SCHEDULER_KEY] = src.scheduler
    return ModelMeta(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if gqa else heads,
        kv_channels=getattr(args, "kv_channels", None) or args.hidden_size // heads,
        max_position_embeddings=(getattr(args, "max_position_embeddings", None)
                                 or args.seq_length),
        vocab_size=_true_vocab_size(args, padded, true_vocab_size, src.file(0, 0)),
        padded_vocab_size=padded, position_embedding_type=position,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_base=getattr(args, "rotary_base", 10000),
        normalization=getattr(args, "normalization", "LayerNorm"),
        norm_epsilon=epsilon if epsilon is not None else 1e-5,
        swiglu=getattr(args, "swiglu", False), openai_gelu=getattr(args, "openai_gelu", False),
        quick_geglu=getattr(args, "quick_geglu", False),
        glu_linear_offset=getattr(args, "glu_linear_offset", 0.0),
        activation_func_clamp_value=getattr(args, "activation_func_clamp_value", None),
        add_bias_linear=getattr(args, "add_bias_linear", True),
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        untie_embeddings_and_output_weights=getattr(
            args, "untie_embeddings_and_output_weights", False),
        apply_residual_connection_post_layernorm=getattr(
            args, "apply_residual_connection_post_layernorm", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        **_rope_scaling_fields(args),
        **_attention_fields(args, src.file(0, 0)),
        params_dtype=_params_dtype(args), seq_length=getattr(args, "seq_length", None),
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128) or 1,
        tokenizer_type=getattr(args, "tokenizer_type", None),
        vocab_file=_abspath(getattr(args, "vocab_file", None)),
        merge_file=_abspath(getattr(args, "merge_file", None)),
        tokenizer_model=_abspath(getattr(args, "tokenizer_model", None)),
        iteration=0 if src.release else src.iteration,
        consumed_train_samples=getattr(args, "consumed_train_samples", 0) or 0,
        consumed_valid_samples=getattr(args, "consumed_valid_samples", 0) or 0,
        model_type="BERT" if src.bert else "GPT", num_tokentypes=src.num_tokentypes,
        bert_binary_head=src.binary_head, source_args=source_args,
        optimizer=getattr(src, "optimizer", None),
        optimizer_note=getattr(src, "optimizer_note", ""),
        mtp_num_layers=getattr(args, "mtp_num_layers", None) or 0,
        **_moe_fields(args, src.file(0, 0)), **_mla_fields(args))


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def _mla_fields(args) -> dict:
    """``ModelMeta``'s multi-latent attention fields from saved args (none without the flag)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    defaults = ModelMeta(1, 1, 1, 1, 1, 1, 1, 1, 1)
    return dict(multi_latent_attention=True,
                **{name: getattr(args, name, getattr(defaults, name)) for name in MLA_FIELDS})


def _rope_scaling_fields(args) -> dict:
    """The rotary rescaling flags of the saved args (absent in older files: the defaults)."""
    defaults = ModelMeta(1, 1, 1, 1, 1, 1, 1, 1, 1).rope_scaling_fields
    return {name: getattr(args, name, default) for name, default in defaults.items()}


def _refuse_shared_expert_gate(src: _Source, meta: ModelMeta) -> None:
    """A shared expert's gate the saved args do not name (no ``--moe-shared-expert-gate``):
    refuse rather than drop it."""
    if not meta.moe_shared_expert_intermediate_size or meta.moe_shared_expert_gate:
        return
    pp_rank, chunk, local = src.layer_map[0]
    language_model, path = src._language_model(0, pp_rank, chunk)
    if f"layers.{local}.mlp.shared_experts.gate_weight" in _encoder(language_model, path):
        raise ConversionError(f"{path}: holds mlp.shared_experts.gate_weight but its args lack "
                              "--moe-shared-expert-gate")


def load_megatron(load_dir: str, ckpt_step: Optional[int] = None, *,
                  true_vocab_size: Optional[int] = None,
                  view: Optional[str] = None) -> Iterator[Piece]:
    """Yield the canonical stream of the Megatron checkpoint in ``load_dir``.

    Args:
        load_dir: the folder holding ``latest_checkpointed_iteration.txt``.
        ckpt_step: read this iteration instead of the tracker's.
        true_vocab_size: the tokenizer's size (``--true-vocab-size``); by default it is learned
            by building the tokenizer the saved args name.
        view: None for the weights; ``exp_avg``, ``exp_avg_sq`` or ``main`` for that field of
            the optimizer state, streamed in the weights' shapes (:mod:`optimizer_state`).

    Raises:
        ConversionError: a missing tracker, folder, rank file or tensor, naming it.
    """
    src = _Source(load_dir, ckpt_step, view)
    meta = _meta_from_args(src, true_vocab_size)
    if src.bert and meta.untie_embeddings_and_output_weights:
        raise ConversionError(f"{src.file(0, 0)}: a BERT checkpoint (it has lm_head) whose args "
                              "say --untie-embeddings-and-output-weights; BERT's LM head is "
                              "tied to the word embeddings")
    yield Piece("meta", meta=meta)

    embedding = ["embedding"]
    word = src.read_tp(0, 0, embedding + ["word_embeddings", "weight"], 0)
    if word.size(0) != meta.padded_vocab_size:
        raise ConversionError(f"{src.file(0, 0)}: the word embeddings have {word.size(0)} rows "
                              f"but the saved args say padded_vocab_size "
                              f"{meta.padded_vocab_size}")
    tensors = {"word_embeddings": word}
    if meta.position_embedding_type == "learned_absolute":
        tensors["position_embeddings"] = src.read_tp(
            0, 0, embedding + ["position_embeddings", "weight"], None)
    if meta.num_tokentypes:
        tensors["tokentype_embeddings"] = src.read_model(0, 0, ".".join(TOKENTYPE_KEYS), None)
    yield Piece("embeddings", tensors)
    del tensors, word

    _refuse_shared_expert_gate(src, meta)
    for index in range(meta.num_layers):
        yield Piece("layer", src.read_layer(index, layer_tensor_names(meta, index),
                                      meta.gated_linear_unit),
                    index=index)

    last, last_chunk = src.pp - 1, (src.vp or 1) - 1
    norm_names = ["weight", "bias"] if meta.normalization == "LayerNorm" else ["weight"]
    norm = {name: src.read_tp(*src.mtp_stage(), ["encoder", f"final_layernorm.{name}"], None)
            for name in norm_names}
    yield Piece("final_norm", norm)
    if meta.untie_embeddings_and_output_weights:
        yield Piece("output_layer", {"weight": src.read_tp(
            last, last_chunk, ["output_layer", "weight"], 0)})
    if meta.model_type == "BERT":
        yield from _read_bert_heads(src, meta)
    names = list(mtp_tensor_shapes(meta)) if meta.mtp_num_layers else []
    for depth in range(meta.mtp_num_layers):
        yield Piece("mtp", src.read_mtp(depth, names, meta.swiglu), index=depth)


def _read_bert_heads(src: _Source, meta: ModelMeta) -> Iterator[Piece]:
    """BERT's pooler, LM head and binary head from the last stage: the ``lm_head`` bias joined
    over TP (vocab-parallel), every other tensor rank 0's (replicated)."""
    last, last_chunk = src.pp - 1, (src.vp or 1) - 1
    for kind, shapes in bert_head_shapes(meta, meta.padded_vocab_size):
        tensors = {}
        for name, shape in shapes.items():
            vocab = (kind, name) == BERT_VOCAB_TENSOR
            dotted = ".".join(BERT_HEAD_KEYS[kind] + (name,))
            tensors[name] = src.read_model(last, last_chunk, dotted, 0 if vocab else None)
            if tuple(tensors[name].shape) != shape:
                raise ConversionError(f"{src.file(0, last)}: {dotted} has shape "
                                      f"{tuple(tensors[name].shape)} in all, expected {shape} "
                                      "from the saved args")
        yield Piece(kind, tensors)


# ---------------------------------------------------------------------------------------------
