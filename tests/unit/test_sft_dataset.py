"""--sft: SFTTokenizer's prompt formats and the packed JSONL conversation samples.

The reference for a conversation's tokens is a Jinja chat template of the format, rendered and
tokenized by transformers' ``apply_chat_template`` over the same local tokenizer.json; the loss
mask is rebuilt from the templates of the growing prefixes of the conversation. The tokenizer is
a small byte-level BPE trained here, so nothing is downloaded.
"""

import json
import os

import pytest

from megatron.data.dataset_utils import DataError
from megatron.data.sft_dataset import (build_sft_datasets, pack_conversations,
                                       read_conversations_jsonl)
from megatron.tokenizer.sft_tokenizer import SFTTokenizer

SPECIALS = ["<|endoftext|>", "<unk>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
            "<SPECIAL_233>"]
CORPUS = ["What is the capital of France? The capital of France is Paris.",
          "You are a helpful assistant. Answer briefly and politely.",
          "Count from one to five: one two three four five.",
          "User Assistant System think no_think \n\n", "Assistant\nUser\nSystem\n"] * 20

# The formats as Jinja templates (the reference path renders these with transformers).
JINJA = {
    "nemotron-h-aligned": (
        "{% for m in messages %}"
        "{% if m.role == 'system' %}<SPECIAL_10>System\n{{ m.content | trim }}\n"
        "{% elif m.role == 'user' %}<SPECIAL_11>User\n{{ m.content | trim }}\n"
        "<SPECIAL_11>Assistant\n"
        "{% else %}{{ m.content | trim }}\n{% endif %}{% endfor %}"),
    "nemotron-nano-v2": (
        "{% for m in messages %}"
        "{% set c = m.content.replace('/think', '').replace('/no_think', '') %}"
        "{% if m.role == 'system' %}<SPECIAL_10>System\n{{ c | trim }}\n"
        "{% elif m.role == 'user' %}<SPECIAL_11>User\n{{ c | trim }}\n"
        "{% else %}<SPECIAL_11>Assistant\n{{ m.content | trim }}\n<SPECIAL_12>\n"
        "{% endif %}{% endfor %}"),
}
HEADER_TOKENS = {"nemotron-h-aligned": 0, "nemotron-nano-v2": 3}

CONVERSATION = [
    {"role": "system", "content": "  You are a helpful assistant. /no_think"},
    {"role": "user", "content": "What is the capital of France?\n"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Count from one to five. /think"},
    {"role": "assistant", "content": " one two three four five "},
]


def write_tokenizer(folder) -> str:
    """A byte-level BPE tokenizer.json (about 300 tokens) with the formats' special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("sft_tok"))


def reference_ids(tokenizer_dir, fmt, messages):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokenizer_dir, "tokenizer.json"))
    out = hf.apply_chat_template(messages, chat_template=JINJA[fmt], tokenize=True,
                                 return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def reference_sample(tokenizer_dir, fmt, messages):
    """Ids of the whole conversation, and 1 on the ids of its assistant turns past the header:
    a turn's ids are those the template of messages[:k + 1] adds to that of messages[:k]."""
    ids = reference_ids(tokenizer_dir, fmt, messages)
    trained = [0] * len(ids)
    for k, turn in enumerate(messages):
        begin = len(reference_ids(tokenizer_dir, fmt, messages[:k])) if k else 0
        end = len(reference_ids(tokenizer_dir, fmt, messages[:k + 1]))
        if turn["role"] == "assistant":
            trained[begin + HEADER_TOKENS[fmt]:end] = [1] * (end - begin - HEADER_TOKENS[fmt])
    return ids, trained


@pytest.mark.parametrize("fmt", ["nemotron-h-aligned", "nemotron-nano-v2"])
def test_conversation_tokens_and_loss_match_the_chat_template(tokenizer_dir, fmt):
    tok = SFTTokenizer(tokenizer_dir, fmt)
    tokens, trained = tok.tokenize_conversation(CONVERSATION)
    want_ids, want_trained = reference_sample(tokenizer_dir, fmt, CONVERSATION)
    assert tokens.tolist() == want_ids
    assert trained.tolist() == want_trained
    # The prompt carries no loss: the trained tokens spell the assistant answers exactly.
    answers = [t["content"].strip() + "\n" for t in CONVERSATION if t["role"] == "assistant"]
    if fmt == "nemotron-nano-v2":
        answers = [a + "<SPECIAL_12>\n" for a in answers]
    assert tok.detokenize(tokens[trained == 1].tolist()) == "".join(answers)
    assert "User" not in tok.detokenize(tokens[trained == 1].tolist())


@pytest.mark.parametrize("fmt", ["nemotron-h-aligned", "nemotron-nano-v2"])
def test_packed_sample_of_two_conversations(tokenizer_dir, fmt):
    tok = SFTTokenizer(tokenizer_dir, fmt)
    first, second = CONVERSATION[:3], [CONVERSATION[0]] + CONVERSATION[3:]
    a_ids, a_trained = reference_sample(tokenizer_dir, fmt, first)
    b_ids, b_trained = reference_sample(tokenizer_dir, fmt, second)
    eod, pad = tok.vocab["<|endoftext|>"], tok.vocab[SPECIALS[-1] if fmt ==
                                                     "nemotron-h-aligned" else "<unk>"]
    pack = a_ids + [eod] + b_ids + [eod]
    trained = a_trained + [1] + b_trained + [1]
    seq_length = len(pack) + 5
    got = pack_conversations([first, second], tok, seq_length)
    full = pack + [pad] * 6
    assert got["tokens"].tolist() == full[:-1] and got["labels"].tolist() == full[1:]
    assert got["loss_mask"].tolist() == (trained + [0] * 6)[1:]
    n = len(a_ids) + 1
    assert got["position_ids"].tolist() == (list(range(n)) + list(range(len(pack) - n + 6)))[:-1]
    assert got["segment_ids"].tolist() == [0] * n + [1] * (seq_length - n)

    # Cut: seq_length tokens of the pack, then one padding token; nothing after it trains.
    cut = pack_conversations([first, second], tok, n + 3)
    assert cut["tokens"].tolist() == pack[:n + 3]
    assert cut["labels"].tolist() == pack[1:n + 3] + [pad]
    assert cut["loss_mask"].tolist() == trained[1:n + 3] + [0]
    assert cut["position_ids"].tolist() == list(range(n)) + [0, 1, 2]


def _write_jsonl(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


GOOD = json.dumps({"messages": CONVERSATION})


@pytest.mark.parametrize("line, words", [
    ("{not json", "not a JSON object"),
    ('["messages"]', '"messages" key'),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "turn 0"),
    ('{"messages": [{"role": "user", "content": 3}]}', "turn 0"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}',
     "empty assistant"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     "does not follow a user turn"),
])
def test_malformed_jsonl_is_refused_naming_file_and_line(tmp_path, line, words):
    path = _write_jsonl(tmp_path / "chat.jsonl", [GOOD, "", GOOD, line, GOOD])
    with pytest.raises(DataError) as err:
        read_conversations_jsonl(path)
    assert f"{path}:4:" in str(err.value) and words in str(err.value)


def test_splits_cycle_through_their_lines_in_file_order(tokenizer_dir, tmp_path):
    tok = SFTTokenizer(tokenizer_dir, "nemotron-h-aligned")
    lines = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": f"answer {i}"}]} for i in range(10)]
    path = _write_jsonl(tmp_path / "chat.jsonl", [json.dumps(x) for x in lines])
    train, valid, test = build_sft_datasets([path], [13, 4, 0], 32, "80,20,0", tok)
    assert test is None and len(train) == 13 and len(valid) == 4
    for i in range(13):
        want = pack_conversations([lines[i % 8]["messages"]], tok, 32)
        assert train[i]["tokens"].tolist() == want["tokens"].tolist()
    assert valid[3]["tokens"].tolist() == pack_conversations(
        [lines[8 + 3 % 2]["messages"]], tok, 32)["tokens"].tolist()


def test_unknown_prompt_format_and_missing_pad_token_are_refused(tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="--sft-tokenizer-prompt-format 'llama3' is not built"):
        SFTTokenizer(tokenizer_dir, "llama3")
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a"))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="'<SPECIAL_233>' is not a token"):
        SFTTokenizer(str(tmp_path), "nemotron-h-aligned")


def test_a_packed_conversation_is_computed_as_if_alone(tokenizer_dir):
    """Logits of the second conversation of a pack (its own positions, rotary angles from them
    as --sft sets, the segment mask) equal those of the conversation run alone from position 0
    (float64; ~1e-15 apart in order only); without the mask, it would see the first
    conversation."""
    import torch

    from megatron.data.sft_dataset import sft_attention_mask
    from megatron.model import GPTModel
    from tests.unit.test_gpt_model import make_config, single_process_state

    tok = SFTTokenizer(tokenizer_dir, "nemotron-h-aligned")
    first, second = CONVERSATION[:3], [CONVERSATION[0]] + CONVERSATION[3:]
    seq = 96
    packed = pack_conversations([first, second], tok, seq)
    n = int((packed["segment_ids"] == 0).sum())
    alone = pack_conversations([second], tok, seq - n)
    assert sft_attention_mask(torch.from_numpy(alone["segment_ids"])[None]) is None
    model = GPTModel(make_config(padded_vocab_size=384, max_position_embeddings=seq,
                                 seq_length=seq, position_embedding_type="rope",
                                 rotary_from_position_ids=True),
                     single_process_state(), init_seed=3)

    def logits(sample, masked=True):
        ids = torch.from_numpy(sample["tokens"])[None]
        pos = torch.from_numpy(sample["position_ids"])[None]
        mask = sft_attention_mask(torch.from_numpy(sample["segment_ids"])[None]) if masked \
            else None
        with torch.no_grad():
            return model(ids, pos, mask)[0]                  # [s, vocab]

    want = logits(alone)
    assert want.shape == (seq - n, 384)
    torch.testing.assert_close(logits(packed)[n:], want, rtol=0, atol=1e-12)
    assert not torch.allclose(logits(packed, masked=False)[n:], want, atol=1e-6)


SMALL = """--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 2 --lr 1e-3
--train-iters 1 --data-path chat.jsonl""".split()


@pytest.mark.parametrize("extra, pattern", [
    (["--sft", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8"],
     "--sft tokenizes conversations with --tokenizer-type SFTTokenizer"),
    (["--tokenizer-type", "SFTTokenizer", "--sft-tokenizer-prompt-format", "chatml"],
     "--sft-tokenizer-prompt-format 'chatml' is not built"),
    (["--sft", "--tokenizer-type", "SFTTokenizer", "--mock-data"], "--sft cannot be combined "
     "with --mock-data"),
    (["--sft", "--tokenizer-type", "SFTTokenizer", "--reset-attention-mask"],
     "--sft cannot be combined with --reset-attention-mask"),
])
def test_sft_flags_that_cannot_work_are_refused(extra, pattern):
    from megatron.training.arguments import ArgumentsError, parse_args, validate_args

    args = parse_args(argv=SMALL + extra)
    args.world_size = 2
    with pytest.raises(ArgumentsError, match=pattern):
        validate_args(args)


def test_sft_with_context_parallelism_is_accepted():
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=SMALL + ["--sft", "--tokenizer-type", "SFTTokenizer",
                                    "--context-parallel-size", "2"])
    args.world_size = 2
    validate_args(args)
    assert args.sft and args.context_parallel_size == 2


def test_sft_flags_parse_with_megatron_defaults():
    from megatron.training.arguments import parse_args

    args = parse_args(argv=SMALL + ["--tokenizer-type", "SFTTokenizer"])
    assert args.sft is False and args.sft_tokenizer_prompt_format == "nemotron-h-aligned"
    assert parse_args(argv=SMALL + ["--sft"]).sft is True


def test_a_turn_that_tokenizes_across_its_boundary_is_refused_naming_the_line(tmp_path):
    """A tokenizer without the format's markers as special tokens merges a turn's last text
    with the next turn's first: the sample is refused naming file and line, not mis-masked."""
    folder = tmp_path / "tok"
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<|endoftext|>", "<SPECIAL_233>", "a", "b", "ab"])}
    word = Tokenizer(models.BPE(vocab, [("a", "b")]))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(folder)
    word.save(str(folder / "tokenizer.json"))
    tok = SFTTokenizer(str(folder), "nemotron-h-aligned")
    tok._format = type(tok._format)(lambda role, content: content, "<SPECIAL_233>", 0)
    line = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                                            "content": "b"}]}
    path = _write_jsonl(tmp_path / "chat.jsonl", [GOOD, json.dumps(line)])
    train, _, _ = build_sft_datasets([path], [2, 0, 0], 8, "1", tok)
    with pytest.raises(DataError, match=f"{path}:2: the user turn starting at token 0"):
        train[1]
