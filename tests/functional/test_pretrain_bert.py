"""pretrain_bert.py end to end on CPU, on real sentence-split text.

The corpus is the docstrings of the Python standard library's top-level modules (one document per
module), its WordPiece vocabulary is trained by tools/train_tokenizer.py and it is split into
sentences by tools/preprocess_data.py --split-sentences, as a user prepares BERT data. References:
the loss of a fresh model (about ln of the padded vocabulary for masked-LM, ln 2 for sentence
order), the single-process run for other layouts, the run that never stopped for a resumed one,
and fp64 arithmetic for the loss function.
"""

import ast
import glob
import json
import math
import os
import subprocess
import sys
import sysconfig
from types import SimpleNamespace

import pytest
import torch

from megatron.training.arguments import (ArgumentsError, parse_args, validate_args,
                                         validate_bert_args)
from tests.multiprocess import run_on_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The trained vocabulary has between 512 and 1024 tokens, so with this the padded vocabulary is
# 1024 under TP=1 (a multiple of 512) and TP=2 (a multiple of 1024): the same model either way.
VOCAB_SIZE = 1000
DIVISIBLE_BY = 512
PADDED_VOCAB = 1024


def _module_docstrings(path: str) -> str:
    """The module's, classes' and functions' docstrings of one source file, as one text."""
    with open(path, "rb") as f:
        try:
            tree = ast.parse(f.read())
        except (SyntaxError, ValueError):
            return ""
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                texts.append(" ".join(doc.split()))
    return " ".join(texts)


def write_docstring_corpus(path: str, max_bytes: int = 400_000) -> int:
    """JSONL ``{"text": ...}``, one document per standard-library module, in sorted order."""
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        for source in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
            text = _module_docstrings(source)
            if len(text) < 400:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text)
            if written > max_bytes:
                break
    return written


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(data prefix, vocab.txt) of the sentence-split docstring corpus."""
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer
    from tools import preprocess_data, train_tokenizer

    root = tmp_path_factory.mktemp("bert_data")
    corpus, vocab = str(root / "docstrings.jsonl"), str(root / "vocab.txt")
    assert write_docstring_corpus(corpus) > 100_000
    assert train_tokenizer.main(["--input", corpus, "--json-keys", "text", "--tokenizer-type",
                                 "BertWordPieceLowerCase", "--vocab-size", str(VOCAB_SIZE),
                                 "--output", vocab]) == 0
    assert 512 < BertWordPieceTokenizer(vocab).vocab_size <= PADDED_VOCAB
    prefix = str(root / "docstrings")
    assert preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--json-keys",
                                 "text", "--split-sentences", "--tokenizer-type",
                                 "BertWordPieceLowerCase", "--vocab-file", vocab,
                                 "--workers", "1"]) == 0
    return prefix + "_text_sentence", vocab


def bert_flags(data, train_iters: int, *, tp: int = 1, pp: int = 1, micro_batch: int = 4,
               global_batch: int = 4, dropout: float = 0.1, lr: float = 5e-3,
               extra=()) -> list:
    prefix, vocab = data
    flags = f"""
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64 --micro-batch-size {micro_batch}
    --global-batch-size {global_batch} --lr {lr} --min-lr 1e-4 --lr-decay-style cosine
    --lr-warmup-iters 1 --train-iters {train_iters} --weight-decay 0.01 --clip-grad 1.0
    --hidden-dropout {dropout} --attention-dropout {dropout} --log-interval 1
    --eval-interval 1000 --eval-iters 2 --tokenizer-type BertWordPieceLowerCase
    --make-vocab-size-divisible-by {DIVISIBLE_BY} --split 90,8,2 --num-workers 0
    --device cpu --seed 1234 --tensor-model-parallel-size {tp}
    --pipeline-model-parallel-size {pp} --ckpt-format torch
    """.split()   # BERT saves the torch format only
    return flags + ["--vocab-file", vocab, "--data-path", prefix] + list(extra)


def run_bert(argv):
    """pretrain() with pretrain_bert's providers in this (initialised) process.

    Returns the iteration reached, the ``lm loss`` of each iteration, and the loss dict of every
    micro-batch this rank's loss function saw (training and evaluation), as floats.
    """
    import pretrain_bert
    from megatron.training import global_vars
    from megatron.training.training import pretrain

    real_loss_func = pretrain_bert.loss_func
    logged = []

    def recording_loss_func(*args):
        loss, reported = real_loss_func(*args)
        logged.append({key: float(value) for key, value in reported.items()})
        return loss, reported

    pretrain_bert.loss_func = recording_loss_func
    try:
        state = pretrain(pretrain_bert.train_valid_test_datasets_provider,
                         pretrain_bert.model_provider, None, pretrain_bert.forward_step,
                         extra_args_provider=pretrain_bert.extra_args_provider, argv=argv)
        return {"iteration": state.iteration, "losses": state.train_loss_history,
                "logged": logged, "padded_vocab_size": global_vars.get_args().padded_vocab_size,
                "valid": state.final_valid_losses}
    finally:
        pretrain_bert.loss_func = real_loss_func
        global_vars.unset_global_variables()


def _lm(result):
    return [loss for _, loss in result["losses"]]


def _keys(tree, prefix=""):
    out = set()
    for key, value in tree.items():
        out |= _keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return out


def _saved_model_keys(save_dir: str, iteration: int) -> set:
    from megatron.training.checkpointing import checkpoint_file, load_state_file

    return _keys(load_state_file(checkpoint_file(save_dir, iteration, 0, 0, 1))["model"])


def test_mlm_and_sop_losses_fall(data):
    iters = 60
    out = run_on_ranks(run_bert, 1, bert_flags(data, iters, dropout=0.0, lr=2e-2,
                                               micro_batch=16, global_batch=16))[0]
    assert out["iteration"] == iters and out["padded_vocab_size"] == PADDED_VOCAB
    lm = _lm(out)
    # A fresh model predicts about uniformly over the padded vocabulary: ln(1024) = 6.93.
    assert abs(lm[0] - math.log(PADDED_VOCAB)) < 0.2, lm[:3]
    first, last = sum(lm[:5]) / 5, sum(lm[-5:]) / 5
    assert last < first - 0.5, lm
    train = out["logged"][:iters]  # one micro-batch per iteration; evaluation comes after
    assert all(set(d) == {"lm loss", "sop loss"} for d in out["logged"])
    assert [d["lm loss"] for d in train] == pytest.approx(lm, rel=1e-6)
    # Sentence order starts at chance (ln 2) and stays finite.
    assert abs(train[0]["sop loss"] - math.log(2)) < 0.2
    assert all(math.isfinite(d["sop loss"]) for d in train)
    assert out["valid"]["lm loss"] < math.log(PADDED_VOCAB) - 0.8, out["valid"]


def test_same_seed_and_flags_give_identical_losses(data):
    """Dropout on: the data order, masks and dropout streams all follow --seed."""
    flags = bert_flags(data, 4)
    a = run_on_ranks(run_bert, 1, flags)[0]
    b = run_on_ranks(run_bert, 1, flags)[0]
    assert a["logged"] == b["logged"]
    other = run_on_ranks(run_bert, 1, [f if f != "1234" else "4321" for f in flags])[0]
    assert other["logged"] != a["logged"]


def _assert_same_losses(name, base, other):
    """Every micro-batch's lm and sop losses agree to 1e-4 relative."""
    assert len(other) == len(base), name
    for a, b in zip(base, other):
        assert set(a) == set(b) == {"lm loss", "sop loss"}
        for key in a:
            assert abs(a[key] - b[key]) < 1e-4 * abs(a[key]), (name, key, base, other)


def test_tensor_and_pipeline_parallel_match_single_rank(data):
    """TP=2, TP=2 with sequence parallelism, and PP=2 train the same model as one process
    (dropout off).

    fp32 sums in another order differ by ~1e-6 relative per step; after 5 Adam steps the losses
    agree to well within 1e-4.
    """
    base = run_on_ranks(run_bert, 1, bert_flags(data, 5, dropout=0.0))[0]["logged"]
    for name, ranks, flags in (
            ("tp=2", 2, bert_flags(data, 5, dropout=0.0, tp=2)),
            ("tp=2 sp", 2, bert_flags(data, 5, dropout=0.0, tp=2, extra=["--sequence-parallel"])),
            ("pp=2", 2, bert_flags(data, 5, dropout=0.0, pp=2))):
        _assert_same_losses(name, base, run_on_ranks(run_bert, ranks, flags)[-1]["logged"])


def test_data_parallel_matches_accumulation(data):
    """DP=2 with one micro-batch of 2 each == one rank accumulating two micro-batches of 2.

    As in Megatron, the masked-LM loss is a mean over each micro-batch's masked tokens, and a
    global batch averages those means, so the reference for DP is accumulation over the same
    micro-batches (one micro-batch of 4 weights its tokens differently).
    """
    accumulated = run_on_ranks(run_bert, 1, bert_flags(data, 5, dropout=0.0, micro_batch=2))[0]
    dp2 = run_on_ranks(run_bert, 2, bert_flags(data, 5, dropout=0.0, micro_batch=2))[-1]
    assert [i for i, _ in dp2["losses"]] == [1, 2, 3, 4, 5]
    for a, b in zip(_lm(accumulated), _lm(dp2)):
        assert abs(a - b) < 1e-4 * abs(a), (_lm(accumulated), _lm(dp2))


@pytest.mark.slow
def test_interleaved_and_3d_layouts_match_single_rank(data):
    """4 layers in 4 virtual stages over PP=2, and TP=2 x PP=2 on 4 ranks (dropout off)."""
    def four_layers(flags):
        flags[flags.index("--num-layers") + 1] = "4"
        return flags

    base = run_on_ranks(run_bert, 1, four_layers(bert_flags(
        data, 4, dropout=0.0, global_batch=8)))[0]["logged"]
    interleaved = run_on_ranks(run_bert, 2, four_layers(bert_flags(
        data, 4, dropout=0.0, pp=2, global_batch=8,
        extra=["--num-layers-per-virtual-pipeline-stage", "1"])))[-1]["logged"]
    _assert_same_losses("pp=2 vp=2", base, interleaved)
    tp2pp2 = run_on_ranks(run_bert, 4, four_layers(bert_flags(
        data, 4, dropout=0.0, tp=2, pp=2, global_batch=8)))[-1]["logged"]
    _assert_same_losses("tp=2 pp=2", base, tp2pp2)


def _resume_matches_straight_run(data, tmp_path, tp: int):
    n = 3
    straight = run_on_ranks(run_bert, tp, bert_flags(data, 2 * n, tp=tp))[-1]
    save = str(tmp_path / f"ckpt_tp{tp}")
    first = run_on_ranks(run_bert, tp, bert_flags(
        data, 2 * n, tp=tp, extra=["--save", save, "--exit-interval", str(n)]))[-1]
    assert first["iteration"] == n
    second = run_on_ranks(run_bert, tp, bert_flags(
        data, 2 * n, tp=tp, extra=["--save", save, "--load", save]))[-1]
    assert [i for i, _ in second["losses"]] == list(range(n + 1, 2 * n + 1))
    assert first["logged"] == straight["logged"][:n]
    assert second["logged"] == straight["logged"][n:], (straight, second)
    return save


def test_resume_is_bit_exact(data, tmp_path):
    """2N iterations straight == N, save, new processes load and run N more (dropout on)."""
    save = _resume_matches_straight_run(data, tmp_path, tp=1)
    keys = _saved_model_keys(save, 3)
    for expected in ("language_model.embedding.tokentype_embeddings.weight",
                     "language_model.pooler.dense.weight", "binary_head.weight",
                     "lm_head.dense.weight", "lm_head.layernorm.weight", "lm_head.bias"):
        assert expected in keys, sorted(keys)


@pytest.mark.slow
def test_resume_is_bit_exact_tp2(data, tmp_path):
    _resume_matches_straight_run(data, tmp_path, tp=2)


def test_no_binary_head_trains_and_logs_no_sop_loss(data, tmp_path):
    save = str(tmp_path / "ckpt")
    out = run_on_ranks(run_bert, 1, bert_flags(
        data, 4, dropout=0.0, extra=["--bert-no-binary-head", "--save", save]))[0]
    assert out["iteration"] == 4
    assert out["logged"] and all(set(d) == {"lm loss"} for d in out["logged"])
    keys = _saved_model_keys(save, 4)
    assert "lm_head.bias" in keys
    assert not [k for k in keys if "binary_head" in k or "pooler" in k or "tokentype" in k], keys
    # Loading it with the binary head names that flag; at another layout, the conversion hint
    # names the BERT model type.
    with pytest.raises(AssertionError, match=r"model shape differs from the flags: the BERT "
                       r"binary head \(--bert-no-binary-head removes it\) \(checkpoint False, "
                       r"flags True\)"):
        run_on_ranks(run_bert, 1, bert_flags(data, 6, dropout=0.0, extra=["--load", save]))
    with pytest.raises(AssertionError, match=r"convert it first: python "
                       r"tools/checkpoint/convert.py --model-type BERT --loader megatron"):
        run_on_ranks(run_bert, 2, bert_flags(data, 6, tp=2, dropout=0.0, extra=[
            "--bert-no-binary-head", "--load", save]))


def _fake_parallel_state(monkeypatch):
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_PARALLEL_STATE", SimpleNamespace(dp_size=1))


def test_loss_func_against_fp64(monkeypatch):
    """Masked-LM mean over the loss mask, plus the sentence-order cross entropy, as fp64 math."""
    import pretrain_bert

    _fake_parallel_state(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    lm_losses = torch.rand(3, 8, generator=gen) * 5  # [b, s]
    loss_mask = (torch.rand(3, 8, generator=gen) < 0.3).long()
    loss_mask[:, 0] = 1
    logits = torch.randn(3, 2, generator=gen)
    order = torch.tensor([1, 0, 1])
    loss, logged = pretrain_bert.loss_func(loss_mask, order, (lm_losses, logits))
    m = loss_mask.double()
    lm_ref = (lm_losses.double() * m).sum() / m.sum()
    log_probs = logits.double().log_softmax(-1)
    sop_ref = -log_probs[torch.arange(3), order].mean()
    assert float(logged["lm loss"]) == pytest.approx(float(lm_ref), rel=1e-6)
    assert float(logged["sop loss"]) == pytest.approx(float(sop_ref), rel=1e-6)
    assert float(loss) == pytest.approx(float(lm_ref + sop_ref), rel=1e-6)
    loss, logged = pretrain_bert.loss_func(loss_mask, order, (lm_losses, None))
    assert set(logged) == {"lm loss"} and float(loss) == pytest.approx(float(lm_ref), rel=1e-6)


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 1").split()


@pytest.mark.parametrize("extra, must_name", [
    (["--mask-prob", "1.5"], "--mask-prob must be in (0, 1), got 1.5"),
    (["--mask-prob", "0"], "--mask-prob must be in (0, 1), got 0.0"),
    (["--short-seq-prob", "-0.1"], "--short-seq-prob must be in [0, 1], got -0.1"),
    (["--seq-length", "64"], "--seq-length (64) exceeds --max-position-embeddings (32)"),
])
def test_bad_bert_flags_name_the_flag(extra, must_name):
    args = parse_args(argv=BASE + extra)
    with pytest.raises(ArgumentsError) as err:
        validate_args(args)
    assert must_name in str(err.value)


@pytest.mark.parametrize("extra, must_name", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer"),
    (["--position-embedding-type", "rope"], "--position-embedding-type rope"),
    (["--mock-data"], "--mock-data"),
    (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2: BERT"),
])
def test_flags_bert_cannot_use_name_the_flag(extra, must_name):
    args = parse_args(argv=BASE + ["--tokenizer-type", "BertWordPieceCase"] + extra)
    with pytest.raises(ArgumentsError) as err:
        validate_bert_args(args)
    assert must_name in str(err.value)


def test_a_bert_save_takes_the_torch_format_with_a_note(capsys):
    """torch_dist holds GPT models only here: a BERT run that saves (Megatron's BERT scripts
    give no --ckpt-format) writes the torch format and says so."""
    bert = BASE + ["--tokenizer-type", "BertWordPieceCase"]
    args = parse_args(argv=bert + ["--save", "ckpt"])
    validate_bert_args(args)
    assert args.ckpt_format == "torch"
    assert "this BERT run saves --ckpt-format torch" in capsys.readouterr().out
    args = parse_args(argv=bert)   # nothing saved: the flag is left as it is
    validate_bert_args(args)
    assert args.ckpt_format == "torch_dist"


@pytest.mark.parametrize("given", [["--ckpt-format", "torch_dist"], ["--ckpt-format=torch_dist"],
                                   ["--use-dist-ckpt"]])
def test_a_bert_save_asked_for_in_torch_dist_is_refused(given):
    """A format the user chose is never swapped for another: one line naming the flag."""
    args = parse_args(argv=BASE + ["--tokenizer-type", "BertWordPieceCase", "--save", "ckpt"]
                      + given)
    with pytest.raises(ArgumentsError, match="--ckpt-format torch_dist stores GPT models only"):
        validate_bert_args(args)


def test_defaults_are_megatron_bert():
    import pretrain_bert

    args = validate_args(parse_args(pretrain_bert.extra_args_provider, argv=BASE))
    assert args.tokenizer_type == "BertWordPieceLowerCase"
    assert args.bert_binary_head and args.mask_prob == 0.15 and args.short_seq_prob == 0.1
    validate_bert_args(args)
    assert not parse_args(argv=BASE + ["--bert-no-binary-head"]).bert_binary_head


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("case", ["gpt2 tokenizer", "context parallel",
                                  "missing data prefix"])
def test_user_mistake_is_one_line_without_traceback(data, tmp_path, case):
    """``python pretrain_bert.py`` with a mistake: exit != 0, one stderr line naming it."""
    flags = bert_flags(data, 2)
    if case == "gpt2 tokenizer":
        flags += ["--tokenizer-type", "GPT2BPETokenizer"]
        must_name = ["--tokenizer-type GPT2BPETokenizer", "BertWordPieceLowerCase"]
    elif case == "context parallel":
        # Refused as the flags are parsed, before the world size (1 here) is checked against
        # it, and before any process group or model exists.
        flags += ["--context-parallel-size", "2"]
        must_name = ["--context-parallel-size 2: BERT", "--context-parallel-size 1"]
    else:
        missing = str(tmp_path / "no_such" / "corpus_text_sentence")
        flags[flags.index("--data-path") + 1] = missing
        must_name = [missing]
    proc = subprocess.run([sys.executable, "pretrain_bert.py"] + flags, cwd=REPO_ROOT,
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("pretrain_bert.py: error: "), lines
    for text in must_name:
        assert text in lines[0], (text, lines[0])
