"""Converting real BERT checkpoints (written by pretrain_bert.py) with tools/checkpoint/convert.py.

Two tiny BERTs are trained for 2 iterations at TP=2 x PP=2 (dropout off, so every weight,
norms and biases included, moves away from its initial value): one with the binary head and
token types (Megatron's default, pre-LN), one with ``--bert-no-binary-head`` (no pooler, binary
head or token-type table). Each is converted to TP=1 x PP=1 and back to TP=2 x PP=2. The
vocabulary padding is chosen to be the same at both layouts, so every tensor must survive both
ways bit for bit. References, each independent of the converter:

- the raw files, joined by a naive rule table written here (concatenate TP shards along rows
  for the vocabulary tables and QKV / dense_h_to_4h, along columns for the row-parallel weights;
  anything else is rank 0's copy);
- the model: each checkpoint is loaded by the inference start-up at its own layout (strict key
  and shape checks) and run on the same padded batch. TP only reorders sums, so logits agree to
  a few fp32 ulps; 1e-6 on logits of order one catches any misplaced row (~1e-2);
- transformers: the Hugging Face export of the TP=2 x PP=2 checkpoint
  (``MegatronBertForPreTraining``) gives the same masked-LM and sentence-order logits, and
  imports back bit for bit (but for the padding rows, which Hugging Face tables do not have).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.training import checkpointing
from megatron.convert.megatron_io import load_megatron, save_megatron
from megatron.model.module import flatten_state_dict
from tests.multiprocess import run_on_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "team minute idea kid body back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air "
         "teacher force education").split()
VOCAB_LINES = SPECIALS + WORDS
TRUE_VOCAB = len(VOCAB_LINES) + 2            # the tokenizer appends [BOS] and [EOS]
DIVISIBLE_BY = 64                            # padded to 128 rows at TP=1 and at TP=2
PADDED = 128
SEQ, ATOL = 32, 1e-6
NO_BINARY = ["--bert-no-binary-head"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(sentence data prefix, vocab.txt): 120 documents of 4-7 sentences of vocabulary words."""
    from tools import preprocess_data

    root = tmp_path_factory.mktemp("bert_convert_data")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(VOCAB_LINES) + "\n", encoding="utf-8")
    rng = np.random.RandomState(0)
    corpus = root / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(120):
            sentences = []
            for _ in range(rng.randint(4, 8)):
                words = list(rng.choice(WORDS, size=rng.randint(4, 10)))
                sentences.append(" ".join(words).capitalize() + ".")
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    prefix = str(root / "corpus")
    assert preprocess_data.main(["--input", str(corpus), "--output-prefix", prefix,
                                 "--json-keys", "text", "--split-sentences", "--tokenizer-type",
                                 "BertWordPieceLowerCase", "--vocab-file", str(vocab),
                                 "--workers", "1"]) == 0
    return prefix + "_text_sentence", str(vocab)


def bert_flags(data, *, tp, pp, micro_batch=2, extra=()):
    prefix, vocab = data
    flags = f"""
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ}
    --max-position-embeddings {SEQ} --micro-batch-size {micro_batch} --global-batch-size 4
    --lr 1e-2
    --min-lr 1e-4 --lr-decay-style constant --train-iters 2 --weight-decay 0.01
    --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 1000
    --eval-iters 1 --tokenizer-type BertWordPieceLowerCase
    --make-vocab-size-divisible-by {DIVISIBLE_BY} --split 90,8,2 --num-workers 0
    --device cpu --seed 1234 --tensor-model-parallel-size {tp}
    --pipeline-model-parallel-size {pp} --ckpt-format torch
    """.split()   # BERT saves the torch format only
    return flags + ["--vocab-file", vocab, "--data-path", prefix] + list(extra)


# --- on every rank of one process group -------------------------------------------------------

def _train(argv):
    import pretrain_bert
    from megatron.training import global_vars
    from megatron.training.training import pretrain

    try:
        state = pretrain(pretrain_bert.train_valid_test_datasets_provider,
                         pretrain_bert.model_provider, None, pretrain_bert.forward_step,
                         extra_args_provider=pretrain_bert.extra_args_provider, argv=argv)
        return state.iteration
    finally:
        global_vars.unset_global_variables()


def _stage_forward(model, pstate, args, ids, mask, types):
    """This stage's forward; activations go to the next stage by plain send / recv."""
    import torch.distributed as dist

    b, s = ids.shape
    if pstate.pp_rank > 0:
        hidden = torch.empty(s, b, args.hidden_size)                          # [s, b, h]
        dist.recv(hidden, src=pstate.pp_ranks[pstate.pp_rank - 1])
        model.set_input_tensor(hidden)
    first = pstate.pp_rank == 0
    out = model(ids if first else None, mask, types if first and args.bert_binary_head else None)
    if not pstate.is_last_stage():
        dist.send(out.contiguous(), dst=pstate.pp_ranks[pstate.pp_rank + 1])
        return None
    return out


def _evaluate(argv, ids, mask, types):
    """(MLM logits [b, s, V], binary logits [b, 2] or None) on the last stage's first TP / DP
    rank of the checkpoint ``argv`` loads, run at its own layout; None elsewhere."""
    import torch.distributed as dist

    import pretrain_bert
    from megatron.training import global_vars
    from megatron.core import parallel_state
    from megatron.inference import initialize_for_inference, load_model_for_inference

    args, pstate, _ = initialize_for_inference(pretrain_bert.extra_args_provider, argv)
    try:
        chunks, _ = load_model_for_inference(pretrain_bert.model_provider, args, pstate)
        with torch.no_grad():
            out = _stage_forward(chunks[0], pstate, args, ids, mask, types)
        if out is None:
            return None
        logits, binary = out                                                  # [b, s, V/tp]
        parts = [torch.empty_like(logits) for _ in range(pstate.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=pstate.tp_group)
        keep = pstate.tp_rank == 0 and pstate.dp_rank == 0
        return (torch.cat(parts, dim=-1), binary) if keep else None          # [b, s, V]
    finally:
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()


def _session(steps, ids, mask, types):
    """Run ``steps`` in order on every rank: ``("train", argv)``, ``("convert", src, dst, tp,
    pp)`` (rank 0 converts, the others wait) and ``("eval", argv)``; each step's result."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    results = []
    for kind, *params in steps:
        if kind == "train":
            results.append(_train(params[0]))
            parallel_state.destroy_model_parallel()
        elif kind == "convert":
            if dist.get_rank() == 0:
                src, dst, tp, pp = params
                save_megatron(load_megatron(src), dst, tp, pp)
            dist.barrier()
            results.append(None)
        else:
            results.append(_evaluate(params[0], ids, mask, types))
    return results


# --- references -------------------------------------------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, TRUE_VOCAB - 2, (2, SEQ), generator=g)
    ids[:, 0] = 2                                                       # [CLS]
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, SEQ - 7:] = 0
    ids[1, SEQ - 7:] = 0                                                # [PAD]
    types = torch.zeros(2, SEQ, dtype=torch.long)
    types[:, SEQ // 2:] = 1
    types[1, SEQ - 7:] = 0
    return ids, mask, types


def _states(root):
    iteration, release = checkpointing.read_tracker(root)
    iter_dir = os.path.join(root, checkpointing.checkpoint_dir_name(iteration, release))
    tp, pp = checkpointing.saved_layout(iter_dir)
    return {(t, p): checkpointing.load_state_file(
        checkpointing.checkpoint_file(root, iteration, t, p, pp, release))
        for t in range(tp) for p in range(pp)}


def _naive_join(key, shards):
    if key.endswith(("query_key_value.weight", "query_key_value.bias", "dense_h_to_4h.weight",
                     "dense_h_to_4h.bias", "word_embeddings.weight", "lm_head.bias")):
        return torch.cat(shards, 0)
    if key.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")):
        return torch.cat(shards, 1)
    return shards[0]


def _naive_whole(states, layers_per_stage):
    """{flat key at TP=1 x PP=1: tensor} from a TP x PP checkpoint, by name alone."""
    tp = 1 + max(t for t, _ in states)
    pp = 1 + max(p for _, p in states)
    whole = {}
    for p in range(pp):
        flats = [flatten_state_dict(states[(t, p)]["model"]) for t in range(tp)]
        for key in flats[0]:
            if key.startswith("word_embeddings_for_head"):
                continue
            name = key
            if ".layers." in key:
                head, rest = key.split(".layers.")
                local, tail = rest.split(".", 1)
                name = f"{head}.layers.{p * layers_per_stage + int(local)}.{tail}"
            whole[name] = _naive_join(key, [f[key] for f in flats])
    return whole


def _assert_same_tensors(got, want):
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.fixture(scope="module")
def converted(data, tmp_path_factory):
    """Both BERTs trained at TP=2 x PP=2, converted to TP=1 and back, and evaluated at the
    source and the TP=1 layouts (one 4-rank process group for everything)."""
    root = tmp_path_factory.mktemp("bert_convert")
    dirs = {name: str(root / name) for name in ("src", "tp1", "back", "nb_src", "nb_tp1",
                                                 "nb_back")}
    steps = []
    for prefix, extra in (("", []), ("nb_", NO_BINARY)):
        src, tp1, back = (dirs[prefix + name] for name in ("src", "tp1", "back"))
        steps += [("train", bert_flags(data, tp=2, pp=2, extra=["--save", src] + extra)),
                  ("convert", src, tp1, 1, 1), ("convert", tp1, back, 2, 2),
                  ("eval", bert_flags(data, tp=2, pp=2, micro_batch=1,
                                      extra=["--load", src] + extra)),
                  ("eval", bert_flags(data, tp=1, pp=1, micro_batch=1,
                                      extra=["--load", tp1] + extra))]
    per_rank = run_on_ranks(_session, 4, steps, *_batch())
    evals = {}
    for i, (kind, *_) in enumerate(steps):
        if kind == "eval":
            found = [r[i] for r in per_rank if r[i] is not None]
            assert len(found) == 1
            evals[i] = found[0]
    assert [per_rank[0][i] for i in (0, 5)] == [2, 2]                # trained 2 iterations
    return dirs, {"with": (evals[3], evals[4]), "without": (evals[8], evals[9])}


@pytest.mark.parametrize("binary_head", [True, False])
def test_tp2pp2_to_tp1_and_back_is_bit_identical_with_equal_logits(converted, binary_head):
    dirs, evals = converted
    prefix = "" if binary_head else "nb_"
    source, one, back = (_states(dirs[prefix + name]) for name in ("src", "tp1", "back"))
    whole = flatten_state_dict(one[(0, 0)]["model"])
    _assert_same_tensors(whole, _naive_whole(source, layers_per_stage=1))
    assert whole["lm_head.bias"].shape == (PADDED,) and whole["lm_head.bias"].any()
    assert ("binary_head.weight" in whole) == binary_head
    assert ("language_model.pooler.dense.weight" in whole) == binary_head
    assert ("language_model.embedding.tokentype_embeddings.weight" in whole) == binary_head
    for rank in source:
        _assert_same_tensors(flatten_state_dict(back[rank]["model"]),
                             flatten_state_dict(source[rank]["model"]))
    args = one[(0, 0)]["args"]
    assert args.bert_binary_head == binary_head and args.padded_vocab_size == PADDED
    assert one[(0, 0)]["conversion"]["from_layout"] == [2, 2]

    (lm22, sop22), (lm11, sop11) = evals["with" if binary_head else "without"]
    assert lm22.shape == lm11.shape == (2, SEQ, PADDED) and lm22.std() > 0.1
    torch.testing.assert_close(lm11, lm22, atol=ATOL, rtol=0)
    if binary_head:
        torch.testing.assert_close(sop11, sop22, atol=ATOL, rtol=0)
    else:
        assert sop11 is None and sop22 is None


def _cli(*flags):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "tools/checkpoint/convert.py"] + list(flags),
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_hugging_face_export_matches_and_imports_back(converted, tmp_path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")

    dirs, evals = converted
    hf, back = str(tmp_path / "hf"), str(tmp_path / "back")
    out = _cli("--model-type", "BERT", "--saver", "hf", "--load-dir", dirs["src"],
               "--save-dir", hf)
    assert "converted BERT: 2 layers" in out and "megatron TP=2 PP=2" in out, out
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["MegatronBertForPreTraining"]
    assert config["vocab_size"] == TRUE_VOCAB and config["type_vocab_size"] == 2
    assert config["hidden_act"] == "gelu_pytorch_tanh" and config["pad_token_id"] == 0
    model = transformers.MegatronBertForPreTraining.from_pretrained(hf, dtype=torch.float32)
    ids, mask, types = _batch()
    with torch.no_grad():
        got = model.eval()(input_ids=ids, attention_mask=mask, token_type_ids=types)
    lm, sop = evals["with"][0]
    real = mask.bool()
    torch.testing.assert_close(got.prediction_logits[real], lm[real][:, :TRUE_VOCAB],
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(got.seq_relationship_logits, sop, atol=1e-5, rtol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert tokenizer("Time people", add_special_tokens=False)["input_ids"] == [5, 7]

    _cli("--model-type", "BERT", "--loader", "hf", "--saver", "megatron", "--load-dir", hf,
         "--save-dir", back, "--target-tensor-parallel-size", "2",
         "--target-pipeline-parallel-size", "2", "--make-vocab-size-divisible-by",
         str(DIVISIBLE_BY))
    source, again = _states(dirs["src"]), _states(back)
    assert sorted(source) == sorted(again)
    for rank in source:
        want = flatten_state_dict(source[rank]["model"])
        got_flat = flatten_state_dict(again[rank]["model"])
        assert sorted(got_flat) == sorted(want)
        rows = PADDED // 2
        for key, tensor in want.items():
            if key.endswith(("word_embeddings.weight", "word_embeddings_for_head.weight",
                             "lm_head.bias")):
                real_rows = max(0, min(rows, TRUE_VOCAB - rank[0] * rows))   # this shard's
                assert torch.equal(got_flat[key][:real_rows], tensor[:real_rows]), key
                assert not got_flat[key][real_rows:].any(), key            # padding: zeros
            else:
                assert torch.equal(got_flat[key], tensor), key
    assert again[(0, 0)]["args"].bert_binary_head is True


def test_model_type_must_name_what_the_checkpoint_holds(converted, tmp_path, capsys):
    from tools.checkpoint.convert import main

    dirs, _ = converted
    dst = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-type", "GPT", "--load-dir", dirs["src"], "--save-dir", dst])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (
        f"convert.py: error: --model-type GPT, but --load-dir {dirs['src']} holds a BERT model; "
        "pass --model-type BERT\n")
    assert not os.path.exists(dst)
