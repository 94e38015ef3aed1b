"""Zero-shot evaluation (``tasks/main.py``) against naive float64 references, across layouts.

Checkpoints:

* a seeded, untrained GPT (2 layers, hidden 32, sequence 16, NullTokenizer with 128 ids) saved
  through the real save path at TP=1, TP=2, PP=2 and DP=2 (and, slow, 4 layers at PP=2 with two
  virtual stages). Weights are initialised on the full shape from the seed and then split, so
  every layout holds the same model. ``--init-method-std 0.5`` makes its predictions sharp, so
  a wrong window, mask or stage changes the results visibly.
* a GPT trained on a cycle of words under a byte-level BPE tokenizer built in the test, so that
  LAMBADA passages are predicted right or wrong for certain and strict LAMBADA (every token of
  the last word) differs from the default (the last token only).

References are computed here, one window or passage at a time, by the same weights loaded into a
single-process float64 ``GPTModel``, with the windows, masks, detokenization and word counts
written out naively from their definitions. Other layouts are compared with the TP=1 run.

Tolerance: the evaluation runs in float32, whose per-token losses differ from float64 by ~1e-7
relative; measured on ppl: 2e-7 relative at most. ``RTOL = 1e-5`` still catches a target scored
twice or missed (one of the 166 targets moves the mean loss by ~1e-2), a wrong mask or a stage
wired out of order.
"""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from tests.multiprocess import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTOL = 1e-5
SEQ = 16
NULL_VOCAB = 128
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
         "--device", "cpu", "--num-workers", "0", "--micro-batch-size", "2"]
# The end of document appended after the data ids: 129 ids, eod 128.
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(NULL_VOCAB),
                  "--null-tokenizer-eod-id", str(NULL_VOCAB)]


# ---------------------------------------------------------------------------- rank bodies


def save_seeded_checkpoint(argv):
    """Build the model of ``argv`` from its seed on this layout and save it as iteration 1."""
    import pretrain_gpt
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.core import parallel_state
    from megatron.inference import initialize_for_inference
    from megatron.training.training import build_model_chunks

    args, pstate, _ = initialize_for_inference(None, argv + ["--no-save-optim",
                                                             "--no-save-rng"])
    try:
        chunks = build_model_chunks(pretrain_gpt.model_provider, pstate)
        checkpointing.save_checkpoint(1, chunks, None, None, args, pstate)
    finally:
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()


def evaluate_all(eval_argvs, save_argv=None):
    """Optionally save a seeded checkpoint, then run ``tasks.main.main`` on each argv;
    returns ``[(results, stdout)]``."""
    from tasks.main import main

    if save_argv is not None:
        save_seeded_checkpoint(save_argv)
    outputs = []
    for argv in eval_argvs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            results = main(argv)
        outputs.append((results, out.getvalue()))
    return outputs


def train_then_evaluate(train_argv, eval_argvs):
    from megatron.core import parallel_state
    from tests.functional.gpt_runs import run_pretrain

    run_pretrain(train_argv)
    parallel_state.destroy_model_parallel()
    return evaluate_all(eval_argvs)


# ---------------------------------------------------------------------------- naive references


def load_float64_model(load_dir, vocab_padded, seq=SEQ, hidden=32, layers=2, heads=4):
    """The checkpoint's TP=1, PP=1 weights in a single-process float64 GPTModel."""
    from megatron.training.checkpointing import load_state_file
    from megatron.core.config import TransformerConfig
    from megatron.model import GPTModel

    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                               padded_vocab_size=vocab_padded, max_position_embeddings=seq,
                               seq_length=seq, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.float64)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(config, pstate)
    with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    state = load_state_file(os.path.join(load_dir, f"iter_{iteration:07d}", "mp_rank_00",
                                         "model_optim_rng.pt"))
    model.load_state_dict(state["model"], strict=True)
    return model.eval()


def logits_of(model, tokens):
    """float64 logits ``[len(tokens), V]`` of one sequence of at most SEQ tokens."""
    ids = torch.tensor(tokens, dtype=torch.long).unsqueeze(0)
    pos = torch.arange(len(tokens)).unsqueeze(0)
    with torch.no_grad():
        return model(ids, pos, None)[0]


def naive_perplexity(model, tokens, seq, stride):
    """Sum and count of the token losses over Megatron's rolling windows, one window at a time;
    also checks that every target is scored exactly once."""
    total, scored = 0.0, []
    start = 0
    while True:
        window = tokens[start:start + seq + 1]
        logp = torch.log_softmax(logits_of(model, window[:-1]), dim=-1)
        first_scored = 0 if start == 0 else seq - stride
        for j in range(first_scored, len(window) - 1):
            total -= float(logp[j, window[j + 1]])
            scored.append(start + j + 1)
        if start + seq >= len(tokens) - 1:
            break
        start += stride
    assert sorted(scored) == list(range(1, len(tokens)))
    return total, len(scored)


def naive_lambada(model, path, tokenize, vocab_size, strict):
    """Passages whose target tokens are all the greedy (argmax over real ids) predictions."""
    correct = total = 0
    with open(path) as f:
        for line in f:
            text = json.loads(line)["text"]
            if strict:
                word = text.split()[-1]
                context = tokenize(text[:text.rfind(word)].strip())
                target = tokenize(" " + word)
            else:
                ids = tokenize(text)
                context, target = ids[:-1], ids[-1:]
            logits = logits_of(model, context + target[:-1])
            predicted = logits[len(context) - 1:, :vocab_size].argmax(dim=-1).tolist()
            correct += predicted == target
            total += 1
    return correct, total


def rel(a, b):
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------------------- seeded model


def write_null_data(folder):
    """Documents of random ids as a .bin/.idx dataset (EOD appended) and the same as JSONL."""
    from megatron.data.indexed_dataset import IndexedDatasetBuilder, get_idx_path

    rng = np.random.RandomState(7)
    docs = [rng.randint(0, NULL_VOCAB, size=rng.randint(5, 40)) for _ in range(9)]
    prefix = os.path.join(folder, "docs_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_item(np.append(doc, NULL_VOCAB).astype(np.int64))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    jsonl = os.path.join(folder, "docs.jsonl")
    with open(jsonl, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": " ".join(map(str, doc))}) + "\n")
    stream = [int(t) for doc in docs for t in list(doc) + [NULL_VOCAB]]
    return prefix, jsonl, stream


def write_null_lambada(folder, model):
    """Passages built so that the seeded model gets about half right: the greedy next id over
    the tokenizer's 129 ids, or another id. Returns the file and the expected count."""
    rng = np.random.RandomState(11)
    lines, expected, padding_wins = [], 0, 0
    for i in range(12):
        context = rng.randint(0, NULL_VOCAB, size=rng.randint(3, 12)).tolist()
        logits = logits_of(model, context)[-1]
        best = int(logits[:NULL_VOCAB + 1].argmax())
        padding_wins += int(logits.argmax()) > NULL_VOCAB
        last = best if i % 2 == 0 else (best + 1) % NULL_VOCAB
        expected += i % 2 == 0
        lines.append(json.dumps({"text": " ".join(map(str, context + [last]))}))
    path = os.path.join(folder, "lambada.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    # Otherwise the test could not tell whether the padded rows are left out of the argmax.
    assert padding_wins > 0
    return path, expected


def null_eval_argvs(load, prefix, jsonl, lambada, pp=1, tp=1, extra=()):
    base = MODEL + NULL_TOKENIZER + ["--load", load,
                                     "--tensor-model-parallel-size", str(tp),
                                     "--pipeline-model-parallel-size", str(pp)] + list(extra)
    return [base + ["--task", "WIKITEXT103", "--valid-data", prefix, "--overlapping-eval", "4",
                    "--global-batch-size", "4"],
            base + ["--task", "WIKITEXT103", "--valid-data", jsonl, prefix,
                    "--overlapping-eval", str(SEQ)],
            base + ["--task", "LAMBADA", "--valid-data", lambada, "--global-batch-size", "4"],
            base + ["--task", "LAMBADA", "--valid-data", lambada, "--strict-lambada"]]


def seeded_argv(load, tp=1, pp=1, extra=()):
    # --ckpt-format torch: load_float64_model reads the one model_optim_rng.pt
    return MODEL + NULL_TOKENIZER + ["--init-method-std", "0.5", "--save", load,
                                     "--ckpt-format", "torch",
                                     "--tensor-model-parallel-size", str(tp),
                                     "--pipeline-model-parallel-size", str(pp)] + list(extra)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """The seeded model at TP=1, its data, references, and the TP=1 evaluation results."""
    folder = str(tmp_path_factory.mktemp("seeded"))
    load = os.path.join(folder, "ckpt_tp1")
    run_on_ranks(save_seeded_checkpoint, 1, seeded_argv(load))
    model = load_float64_model(load, 256)
    prefix, jsonl, stream = write_null_data(folder)
    lambada, expected = write_null_lambada(folder, model)
    data = dict(prefix=prefix, jsonl=jsonl, lambada=lambada, folder=folder)
    outputs = run_on_ranks(evaluate_all, 1, null_eval_argvs(load, prefix, jsonl, lambada))[0]
    return types.SimpleNamespace(model=model, stream=stream, expected=expected, data=data,
                                 outputs=outputs)


def test_perplexity_matches_naive_float64_windows(seeded):
    overlapping, (consecutive_jsonl, consecutive_bin) = (
        seeded.outputs[0][0][0], seeded.outputs[1][0])
    for result, stride in ((overlapping, 4), (consecutive_bin, SEQ)):
        total, count = naive_perplexity(seeded.model, seeded.stream, SEQ, stride)
        assert result["num_tokenized_tokens"] - 1 == count
        assert rel(result["avg loss"], total / count) < RTOL
        assert rel(result["ppl"], math.exp(total / count)) < RTOL
        # No original text in a .bin/.idx dataset: the ratio is 1, adjusted ppl = ppl.
        assert result["token ratio"] == 1.0 and result["adjusted ppl"] == result["ppl"]
    # Windows with more context give another (here better) loss than consecutive ones.
    assert rel(overlapping["ppl"], consecutive_bin["ppl"]) > 1e-3
    # JSONL documents with the end-of-document id appended = the preprocessed dataset.
    assert rel(consecutive_jsonl["ppl"], consecutive_bin["ppl"]) < 1e-12
    words = sum(len(d.split(" ")) + 1 for d in _jsonl_texts(seeded.data["jsonl"]))
    assert consecutive_jsonl["num_original_tokens"] == words == len(seeded.stream)


def _jsonl_texts(path):
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]


def test_result_lines_are_megatrons(seeded):
    result, stdout = seeded.outputs[0][0][0], seeded.outputs[0][1]
    line = (f" validation results on WIKITEXT103 | avg loss: {result['avg loss']:.4E} | "
            f"ppl: {result['ppl']:.4E} | adjusted ppl: {result['adjusted ppl']:.4E} | "
            f"token ratio: 1.0 |")
    assert f"{'-' * (len(line) + 1)}\n{line}\n{'-' * (len(line) + 1)}\n" in stdout
    two_files = seeded.outputs[1][1]
    assert f"validation results on WIKITEXT103 ({seeded.data['jsonl']}) | avg loss:" in two_files
    lambada = seeded.outputs[2]
    n = lambada[0][0]["total examples"]
    assert (f" validation results on LAMBADA | number correct: {seeded.expected:.4E} | "
            f"total examples: {n:.4E} | avg accuracy: {seeded.expected / n:.4E}\n") in lambada[1]


def test_lambada_matches_naive_greedy_check(seeded):
    tokenize = lambda text: [int(t) for t in text.split()]  # noqa: E731 - NullTokenizer
    for strict, (results, _) in ((False, seeded.outputs[2]), (True, seeded.outputs[3])):
        correct, total = naive_lambada(seeded.model, seeded.data["lambada"], tokenize,
                                       NULL_VOCAB + 1, strict)
        assert (correct, total) == (seeded.expected, 12)
        assert results[0]["number correct"] == correct
        assert results[0]["total examples"] == total
        assert results[0]["avg accuracy"] == correct / total


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
                         ids=["tp2", "pp2", "dp2"])
def test_parallel_layouts_agree(seeded, tmp_path, tp, pp, dp):
    """The same model saved and evaluated under another layout gives the TP=1 results; every
    rank returns them, the last rank alone prints them."""
    load = str(tmp_path / "ckpt")
    data = seeded.data
    outputs = run_on_ranks(evaluate_all, tp * pp * dp,
                           null_eval_argvs(load, data["prefix"], data["jsonl"], data["lambada"],
                                           pp=pp, tp=tp),
                           save_argv=seeded_argv(load, tp, pp))
    assert_same_results(outputs, seeded.outputs)
    assert "validation results on WIKITEXT103" in outputs[-1][0][1]
    assert "validation results on" not in outputs[0][0][1]


def test_context_parallel_flag_evaluates_on_replicas(seeded, tmp_path):
    """A training script's --context-parallel-size 2: evaluation runs whole sequences, the two
    context-parallel ranks as data-parallel replicas, and gives the one-process results."""
    load = str(tmp_path / "ckpt")
    data = seeded.data
    outputs = run_on_ranks(evaluate_all, 2,
                           null_eval_argvs(load, data["prefix"], data["jsonl"], data["lambada"],
                                           extra=["--context-parallel-size", "2"]),
                           save_argv=seeded_argv(load))
    assert_same_results(outputs, seeded.outputs)


def assert_same_results(outputs, reference):
    """Every rank's results equal the reference run's (ppl within RTOL, counts exactly)."""
    for rank_outputs in outputs:
        assert len(rank_outputs) == len(reference)
        for (got, _), (want, _) in zip(rank_outputs, reference):
            assert len(got) == len(want)
            for g, w in zip(got, want):
                for key in ("avg loss", "ppl", "adjusted ppl"):
                    if key in w:
                        assert rel(g[key], w[key]) < RTOL, key
                for key in ("number correct", "total examples", "num_tokenized_tokens"):
                    assert g.get(key) == w.get(key), key


@pytest.mark.slow
def test_interleaved_pipeline_agrees(seeded, tmp_path):
    """4 layers: PP=2 with 2 virtual stages per rank against one process (the interleaved
    schedule gets micro-batch counts topped up to a multiple of the pipeline size)."""
    data = seeded.data
    layers = ["--num-layers", "4"]
    argvs = {}
    for name, pp, extra in (("one", 1, layers),
                            ("vp", 2, layers + ["--num-layers-per-virtual-pipeline-stage", "1"])):
        load = str(tmp_path / name)
        argvs[name] = (null_eval_argvs(load, data["prefix"], data["jsonl"], data["lambada"],
                                       pp=pp, extra=extra),
                       seeded_argv(load, pp=pp, extra=extra))
    reference = run_on_ranks(evaluate_all, 1, argvs["one"][0], save_argv=argvs["one"][1])[0]
    outputs = run_on_ranks(evaluate_all, 2, argvs["vp"][0], save_argv=argvs["vp"][1])
    assert_same_results(outputs, reference)


# ---------------------------------------------------------------------------- trained model

WORDS = ["amber", "blizzard", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "iris",
         "juniper", "kestrel", "lagoon"]
HF_SEQ = 32
HF_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(HF_SEQ), "--max-position-embeddings", str(HF_SEQ),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
            "--device", "cpu", "--num-workers", "0"]
# WikiText-style raw text and what the WikiText detokenizer makes of it, worked out by hand from
# its rules: " @-@ " -> "-", " @,@ " -> ",", " , " -> ", ", " . " -> ". ", "( x )" -> "(x)",
# and no space around newlines.
WIKI_LINE = (" = amber blizzard = \n cobalt dune , ember @-@ fjord glacier . harbor ( iris "
             "juniper ) kestrel @,@ lagoon \n")
WIKI_DETOKENIZED = " = amber blizzard =\ncobalt dune, ember-fjord glacier. harbor (iris juniper) " \
                   "kestrel,lagoon\n"


def cycle_run(start, length):
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length))


def build_word_tokenizer(folder):
    """A byte-level BPE with few merges, so most words are several tokens."""
    from tokenizers import ByteLevelBPETokenizer

    rng = np.random.RandomState(3)
    docs = [cycle_run(rng.randint(len(WORDS)), rng.randint(4, 10)) for _ in range(400)]
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(docs, vocab_size=280, min_frequency=2,
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    path = os.path.join(folder, "tokenizer.json")
    tokenizer.save(path)
    return path, docs


def write_word_corpus(folder, tokenizer_path, docs):
    from tokenizers import Tokenizer

    from megatron.data.indexed_dataset import IndexedDatasetBuilder, get_idx_path

    tok = Tokenizer.from_file(tokenizer_path)
    eod = tok.token_to_id("<|endoftext|>")
    prefix = os.path.join(folder, "words_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_item(np.array(tok.encode(doc).ids + [eod], dtype=np.int64))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def write_word_lambada(folder):
    """Runs of the cycle (right last word) and runs whose last word jumps ahead (wrong)."""
    lines = []
    for i in range(10):
        words = cycle_run(i, 4 + i % 3).split()
        if i % 2:
            words[-1] = WORDS[(WORDS.index(words[-1]) + 5) % len(WORDS)]
        lines.append(json.dumps({"text": " ".join(words)}))
    path = os.path.join(folder, "lambada_words.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("trained"))
    tokenizer_path, docs = build_word_tokenizer(folder)
    prefix = write_word_corpus(folder, tokenizer_path, docs)
    load = os.path.join(folder, "ckpt")
    tokenizer_flags = ["--tokenizer-type", "HuggingFaceTokenizer",
                       "--tokenizer-model", tokenizer_path]
    train = HF_MODEL + tokenizer_flags + """
        --micro-batch-size 8 --global-batch-size 16 --lr 3e-3 --min-lr 3e-4
        --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 150 --weight-decay 0.0
        --clip-grad 1.0 --log-interval 50 --eval-interval 1000 --eval-iters 0 --split 100,0,0
        --save-interval 1000 --ckpt-format torch""".split() + ["--data-path", prefix,
                                                                "--save", load]
    lambada = write_word_lambada(folder)
    wiki = os.path.join(folder, "wiki.valid.tokens")
    with open(wiki, "w", encoding="utf-8") as f:
        f.write(WIKI_LINE * 4)
    base = HF_MODEL + tokenizer_flags + ["--load", load, "--micro-batch-size", "4"]
    argvs = [base + ["--task", "LAMBADA", "--valid-data", lambada],
             base + ["--task", "LAMBADA", "--valid-data", lambada, "--strict-lambada"],
             base + ["--task", "WIKITEXT103", "--valid-data", wiki, "--overlapping-eval", "8"]]
    outputs = run_on_ranks(train_then_evaluate, 1, train, argvs)[0]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    return types.SimpleNamespace(
        outputs=outputs, lambada=lambada, wiki=wiki,
        model=load_float64_model(load, 384, seq=HF_SEQ, hidden=64),
        tokenize=lambda text: tokenizer.encode(text).ids)


def test_lambada_strict_and_default_match_naive_greedy_check(trained):
    counts = {}
    for strict, (results, _) in ((False, trained.outputs[0]), (True, trained.outputs[1])):
        correct, total = naive_lambada(trained.model, trained.lambada, trained.tokenize, 280,
                                       strict)
        assert 0 < correct < total == 10  # the file is not trivially all right or all wrong
        assert results[0]["number correct"] == correct
        assert results[0]["total examples"] == total
        counts[strict] = correct
    # Wrong last words are completed right from their own first tokens: only strict LAMBADA,
    # which scores every token of the word, counts them wrong (measured: 9 and 5 of 10).
    assert counts[False] > counts[True]


def test_wikitext_perplexity_detokenized_with_adjusted_ppl(trained):
    result = trained.outputs[2][0][0]
    detokenized = WIKI_DETOKENIZED + WIKI_DETOKENIZED[1:] * 3
    tokens = trained.tokenize(detokenized)
    total, count = naive_perplexity(trained.model, tokens, HF_SEQ, 8)
    words = len((WIKI_LINE * 4).strip().split(" "))
    ratio = (len(tokens) - 1) / (words - 1)
    assert result["num_tokenized_tokens"] == len(tokens)
    assert result["num_original_tokens"] == words
    assert result["token ratio"] == pytest.approx(ratio, rel=1e-15)
    assert rel(result["ppl"], math.exp(total / count)) < RTOL
    assert rel(result["adjusted ppl"], math.exp(total / count * ratio)) < RTOL


# ---------------------------------------------------------------------------- user errors


def run_cli(*flags):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tasks", "main.py"), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bad_jsonl_line_is_named_with_file_and_line(tmp_path):
    bad = tmp_path / "lambada.jsonl"
    bad.write_text('{"text": "1 2 3"}\n\n{"text": "4 5 6"\n')
    done = run_cli(*MODEL, *NULL_TOKENIZER, "--task", "LAMBADA", "--valid-data", str(bad),
                   "--load", str(tmp_path / "no_checkpoint"))
    assert done.returncode == 1, done.stderr
    assert f"error: {bad}:3: not valid JSON" in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_text_key_is_named_with_file_and_line(tmp_path):
    from megatron.data.dataset_utils import DataError
    from megatron.tokenizer import NullTokenizer
    from tasks.zeroshot_gpt.datasets import build_lambada_dataset, build_perplexity_dataset

    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"text": "1 2 3"}\n{"content": "4 5 6"}\n')
    tokenizer = NullTokenizer(NULL_VOCAB, eod_id=NULL_VOCAB)
    with pytest.raises(DataError, match=f'{bad}:2: no string under "text" '
                                        r"\(found \['content'\]\)"):
        build_perplexity_dataset(str(bad), tokenizer, SEQ, 4, 256)
    with pytest.raises(DataError, match=f"{bad}:2: no string under"):
        build_lambada_dataset(str(bad), tokenizer, SEQ, strict=True)


def test_missing_valid_data_and_unknown_task_exit_with_usage_errors(tmp_path):
    done = run_cli("--task", "LAMBADA", *MODEL)
    assert done.returncode == 2
    assert "error: --valid-data is required for --task LAMBADA" in done.stderr
    data = tmp_path / "x.jsonl"
    data.write_text('{"text": "1 2"}\n')
    done = run_cli("--task", "RACE", "--valid-data", str(data), *MODEL)
    assert done.returncode == 2
    assert ("error: --task RACE is not implemented; expected one of WIKITEXT103, LAMBADA"
            in done.stderr)
    assert "Traceback" not in done.stderr
