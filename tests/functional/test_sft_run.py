"""pretrain_gpt.py --sft end to end on CPU: JSONL conversations with a local tokenizer.json train
(the loss on the assistant turns falls), a run resumed from its checkpoint continues bit for bit,
two data-parallel ranks give the one-process losses, and a packed conversation is computed as
if it were alone. Bad flags and a malformed line stop the run with one line."""

import json
import os
import random
import subprocess
import sys

import pytest

from tests.functional.gpt_runs import run_pretrain
from tests.multiprocess import run_on_ranks
from tests.unit.test_sft_dataset import write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
N = 4  # iterations before the checkpoint, and after it


def _conversation(rng):
    start = rng.randrange(len(WORDS) - 3)
    turns = [{"role": "user", "content": f"Count from {WORDS[start]}."},
             {"role": "assistant", "content": " ".join(WORDS[start:start + 4])}]
    if rng.random() < 0.5:
        turns.insert(0, {"role": "system", "content": "Answer briefly."})
    return turns


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_run")
    tokenizer = write_tokenizer(str(folder / "tok"))
    rng = random.Random(0)
    lines = []
    for _ in range(120):
        # Some lines pack two conversations, each opened by its system turn.
        messages = _conversation(rng)
        if messages[0]["role"] == "system" and rng.random() < 0.5:
            messages += [{"role": "system", "content": "Be brief."}] + _conversation(rng)[-2:]
        lines.append(json.dumps({"messages": messages}))
    data = folder / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return tokenizer, str(data)


def flags(setup, iters=2 * N, extra=()):
    tokenizer, data = setup
    return f"""
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 48
    --max-position-embeddings 48 --micro-batch-size 1 --global-batch-size 4 --lr 5e-3
    --train-iters {iters} --log-interval 1 --eval-interval 1000 --eval-iters 1 --split 90,8,2
    --num-workers 0 --device cpu --seed 1234 --hidden-dropout 0.0 --attention-dropout 0.0
    --sft --tokenizer-type SFTTokenizer --tokenizer-model {tokenizer} --data-path {data}
    """.split() + list(extra)


def _losses(out):
    return [loss for _, loss in out["losses"]]


@pytest.mark.slow
def test_sft_trains_and_resumes_bit_for_bit(setup, tmp_path):
    save = str(tmp_path / "ckpt")
    straight = run_on_ranks(run_pretrain, 1, flags(setup, extra=[
        "--save", save, "--save-interval", str(N)]))[0]
    losses = _losses(straight)
    assert len(losses) == 2 * N and sum(losses[N:]) / N < sum(losses[:N]) / N - 0.2, losses
    load = ["--load", save, "--ckpt-step", str(N)]
    resumed = run_on_ranks(run_pretrain, 1, flags(setup, extra=load))[0]
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == losses[N:]


@pytest.mark.slow
def test_two_data_parallel_ranks_give_the_one_process_losses(setup):
    """Micro-batch 1 and global batch 4 on both: each step averages the same four per-sample
    means (one process: four micro-batches; DP 2: two each, then the DP mean), so only the
    summation order of the gradients differs."""
    one = _losses(run_on_ranks(run_pretrain, 1, flags(setup, iters=3))[0])
    two = _losses(run_on_ranks(run_pretrain, 2, flags(setup, iters=3))[0])
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]])
def test_tensor_and_pipeline_splits_give_the_one_process_losses(setup, layout):
    """TP rank 1 receives the packed batch (and its segment mask) by broadcast; with PP the last
    stage reads labels and loss mask, both stages the mask. Float sums in another order only.
    The vocabulary is padded to 512 in both (300 tokens; 256 x TP 2 divides 512)."""
    pad = ["--make-vocab-size-divisible-by", "256"]
    one = _losses(run_on_ranks(run_pretrain, 1, flags(setup, iters=3, extra=pad))[0])
    split = _losses(run_on_ranks(run_pretrain, 2, flags(setup, iters=3, extra=pad + layout))[-1])
    assert split == pytest.approx(one, rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("world, layout", [
    (2, []), (4, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])])
def test_context_parallel_2_gives_the_one_process_losses(setup, world, layout):
    """cp 2 pads each conversation to a multiple of 4 tokens (Megatron's packing); at sequence
    128 no pack is cut either way (checked first), so each pack trains the same tokens with the
    same positions within their conversations, and the losses are the one-process ones up to
    the blockwise softmax's rounding. Two-conversation packs exercise the segment mask; with
    pipeline stages the second stage's layers rotate by the position ids too."""
    from megatron.data.sft_dataset import pack_conversations, split_conversations
    from megatron.tokenizer.sft_tokenizer import SFTTokenizer

    tokenizer, data = setup
    tok = SFTTokenizer(tokenizer, "nemotron-h-aligned")
    with open(data) as f:
        lines = [split_conversations(json.loads(line)["messages"]) for line in f]
    assert sum(len(c) > 1 for c in lines) > 10
    for conversations in lines:
        plain, padded = (pack_conversations(conversations, tok, 128, m)["loss_mask"].sum()
                         for m in (1, 4))
        assert plain == padded
    longer = ["--seq-length", "128", "--max-position-embeddings", "128",
              "--position-embedding-type", "rope", "--num-layers", "4",
              "--make-vocab-size-divisible-by", "256"]
    one = _losses(run_on_ranks(run_pretrain, 1, flags(setup, iters=3, extra=longer))[0])
    cp = _losses(run_on_ranks(run_pretrain, world, flags(setup, iters=3, extra=longer + [
        "--context-parallel-size", "2", *layout]))[-1])
    assert len(one) == 3 and cp == pytest.approx(one, rel=1e-5, abs=1e-6)


def _one_line_error(argv):
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_malformed_line_stops_the_run_naming_file_and_line(setup, tmp_path):
    tokenizer, data = setup
    bad = tmp_path / "bad.jsonl"
    with open(data) as f:
        lines = f.read().splitlines()[:5]
    bad.write_text("\n".join(lines[:2] + ['{"messages": "hello"}'] + lines[2:]) + "\n")
    argv = flags(setup, iters=1)
    argv[argv.index(data)] = str(bad)
    assert f"{bad}:3: \"messages\" must be a non-empty list" in _one_line_error(argv)
