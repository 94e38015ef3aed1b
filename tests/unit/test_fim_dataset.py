"""Fill-in-the-middle samples (--fim-data): the PSM/SPM permutation on given token lists with
scripted draws, the dataset against a naive re-implementation sample by sample on a real BPE
tokenizer, the kept length, rate 0 as the plain dataset bit for bit, and the refusals."""

import os
import pickle

import numpy as np
import pytest

from megatron.data.config import FIMFlags
from megatron.data.dataset_utils import DataError
from megatron.data.fim_dataset import (FIMConfig, fim_sample, permute, resolve_fim_config,
                                       sample_rng)
from megatron.data.gpt_dataset import GPTDataset, GPTDatasetConfig, GPTFIMDataset
from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer.tiktoken_tokenizer import TikTokenizer
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.unit.test_gpt_dataset import write_dataset
from tests.unit.test_tokenizer import gpt2_ranks, tiktoken_vocab  # noqa: F401  (fixtures)

P, M, S, PAD, EOD, SPLIT = 1, 2, 3, 4, 5, 6


class CharTokenizer:
    """One id per character (a=10, b=11, ...), and whole words when ``words`` are given, matched
    longest first: enough to see each piece of a permutation by eye."""

    name = "Char"

    def __init__(self, words=()):
        self.words = sorted(words, key=len, reverse=True)
        self.word_ids = {w: 100 + i for i, w in enumerate(words)}
        self.vocab = {"<fim_prefix>": P, "<fim_middle>": M, "<fim_suffix>": S,
                      "<fim_pad>": PAD, "<|endoftext|>": EOD, "|": SPLIT}

    def tokenize_text(self, text):
        out, i = [], 0
        while i < len(text):
            word = next((w for w in self.words if text.startswith(w, i)), None)
            if word:
                out.append(self.word_ids[word])
                i += len(word)
            else:
                out.append(ord(text[i]) - ord("a") + 10)
                i += 1
        return out

    def detokenize(self, ids):
        inverse = {v: k for k, v in self.word_ids.items()}
        return "".join(inverse.get(i, chr(i - 10 + ord("a"))) for i in ids)


class ScriptedRng:
    """Hands out the given Bernoulli outcomes and cut pairs, checking each cut's range."""

    def __init__(self, coins, cuts=()):
        self.coins, self.cuts = list(coins), list(cuts)

    def binomial(self, n, p):
        assert n == 1
        return self.coins.pop(0)

    def randint(self, low, high, size):
        text_len, pair = self.cuts.pop(0)
        assert (low, high, size) == (0, text_len + 1, 2)
        return np.array(pair)

    def done(self):
        return not self.coins and not self.cuts


def char_config(rate=1.0, spm_rate=0.0, tokenizer=None, **kw):
    return FIMConfig(rate=rate, spm_rate=spm_rate, prefix_id=P, middle_id=M, suffix_id=S,
                     pad_id=PAD, eod_id=EOD, tokenizer=tokenizer or CharTokenizer(), **kw)


def ids(text):
    return np.array(CharTokenizer().tokenize_text(text), dtype=np.int64)


def t(text):
    return CharTokenizer().tokenize_text(text)


# ---------------------------------------------------------------- permutation on given tokens


def test_psm_puts_the_middle_last():
    rng = ScriptedRng([1, 0], [(6, (4, 2))])          # cuts drawn unsorted: sorted to (2, 4)
    got = permute(ids("abcdef"), 1.0, char_config(), rng)
    assert got.tolist() == [P] + t("ab") + [S] + t("ef") + [M] + t("cd")
    assert rng.done()


def test_spm_puts_the_suffix_first():
    rng = ScriptedRng([1, 1], [(6, (1, 5))])
    got = permute(ids("abcdef"), 1.0, char_config(), rng)
    assert got.tolist() == [P, S] + t("f") + [M] + t("a") + t("bcde")


def test_empty_pieces_at_either_end():
    rng = ScriptedRng([1, 0], [(3, (0, 3))])
    assert permute(ids("abc"), 1.0, char_config(), rng).tolist() == [P, S, M] + t("abc")


def test_a_lost_coin_leaves_the_segment_and_draws_nothing_more():
    rng = ScriptedRng([0])
    assert permute(ids("abc"), 0.3, char_config(), rng).tolist() == t("abc")
    assert rng.done()


def test_no_prefix_text_is_left_as_it_is():
    rng = ScriptedRng([1])                            # no cut is drawn after the prefix matches
    got = permute(ids("abcd"), 1.0, char_config(no_prefix="ab"), rng)
    assert got.tolist() == t("abcd") and rng.done()
    rng = ScriptedRng([1, 0], [(4, (1, 2))])
    got = permute(ids("abcd"), 1.0, char_config(no_prefix="b"), rng)
    assert got.tolist() == [P] + t("a") + [S] + t("cd") + [M] + t("b")


def test_document_segments_are_permuted_each_and_the_length_is_kept():
    sample = np.array(t("abc") + [EOD] + t("de"), dtype=np.int64)      # 6 tokens
    rng = ScriptedRng([1, 0, 1, 1], [(3, (1, 2)), (2, (1, 1))])
    got = fim_sample(sample, char_config(), rng)
    whole = [P] + t("a") + [S] + t("c") + [M] + t("b") + [EOD] + [P, S] + t("e") + [M] + t("d")
    assert got.tolist() == whole[:6] and got.dtype == np.int64


def test_empty_segments_keep_their_end_of_document_tokens():
    sample = np.array([EOD] + t("ab") + [EOD, EOD] + t("c") + [EOD], dtype=np.int64)
    rng = ScriptedRng([0, 0])                          # one draw per non-empty segment only
    assert fim_sample(sample, char_config(rate=0.5), rng).tolist() == sample.tolist()
    assert rng.done()


def test_a_shorter_result_is_padded():
    # "abcdef" read back as one word: 6 tokens become [P, S, word, M] and 2 pads
    tokenizer = CharTokenizer(words=["abcdef"])
    sample = ids("abcdef")
    rng = ScriptedRng([1, 0], [(6, (0, 0))])
    got = fim_sample(sample, char_config(tokenizer=tokenizer), rng)
    assert got.tolist() == [P, S, 100, M, PAD, PAD]


def test_fragments_are_permuted_each_between_split_tokens():
    sample = np.array(t("ab") + [SPLIT] + t("cd") + [SPLIT, SPLIT] + t("e"), dtype=np.int64)
    config = char_config(split_id=SPLIT, fragment_rate=0.5)
    # whole-segment coin, then per fragment: ab (permuted PSM), cd (not), e (permuted SPM)
    rng = ScriptedRng([1, 1, 0, 0, 1, 1], [(2, (1, 1)), (1, (0, 1))])
    got = fim_sample(sample, config, rng)
    whole = ([P] + t("a") + [S] + t("b") + [M] + [SPLIT] + t("cd") + [SPLIT, SPLIT]
             + [P, S, M] + t("e"))
    assert got.tolist() == whole[:sample.size] and rng.done()


def test_fragments_wait_for_the_segment_coin():
    sample = np.array(t("ab") + [SPLIT] + t("cd"), dtype=np.int64)
    rng = ScriptedRng([0])
    got = fim_sample(sample, char_config(split_id=SPLIT, fragment_rate=1.0), rng)
    assert got.tolist() == sample.tolist() and rng.done()


def test_a_segment_without_the_split_token_uses_the_sample_rate():
    rng = ScriptedRng([1, 0], [(2, (1, 2))])
    got = fim_sample(ids("ab"), char_config(split_id=SPLIT, fragment_rate=0.0), rng)
    assert got.tolist() == ([P] + t("a") + [S] + [M] + t("b"))[:2]


# ------------------------------------------------------- the dataset on a real BPE tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>",
            "<fim_pad>", "<file_sep>"]
TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n",
         "class Point:\n    x: int = 0<file_sep>y: int = 1\n", "",
         "# a comment<file_sep><file_sep>for i in range(3):\n    pass\n",
         "while True:\n    break\n", "x = [1, 2, 3]\ny = {k: v for k, v in zip(x, x)}\n"]


@pytest.fixture(scope="module")
def bpe(tiktoken_vocab):  # noqa: F811
    path, tokens = tiktoken_vocab
    return TikTokenizer(path, "v2", vocab_size=16 + len(tokens), num_special_tokens=16,
                        special_tokens=SPECIALS)


def fim_flags(**kw):
    values = dict(fim_data=True, fim_eod_token="</s>")
    values.update(kw)
    return FIMFlags(**values)


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory, bpe):
    """The texts, each ending in </s>; the empty text leaves a lone </s> (two in a row)."""
    prefix = str(tmp_path_factory.mktemp("fim") / "code")
    write_dataset(prefix, [bpe.tokenize(text) + [bpe.eod] for text in TEXTS * 3])
    return prefix


def datasets(prefix, fim, seq_length=24, num_samples=40, seed=1234):
    indexed = IndexedDataset(prefix)
    docs = np.arange(len(indexed), dtype=np.int32)
    config = GPTDatasetConfig(seed=seed, seq_length=seq_length, split="1,0,0")
    plain = GPTDataset("train", prefix, indexed, docs, num_samples, config)
    return plain, GPTFIMDataset("train", prefix, indexed, docs, num_samples, config, fim)


def split_list(tokens, separator):
    parts, current = [], []
    for token in tokens:
        if token == separator:
            parts.append(current)
            current = []
        else:
            current.append(token)
    return parts + [current]


def naive_fim(sample, tok, flags, rng):
    """--fim-data written out on Python lists, from the description in fim_dataset's docstring."""
    v = tok.vocab
    pre_id, mid_id, suf_id = (v[flags.fim_prefix_token], v[flags.fim_middle_token],
                              v[flags.fim_suffix_token])
    split = None if flags.fim_split_sample is None else v[flags.fim_split_sample]

    def perm(seg, rate):
        if rng.binomial(1, rate) == 0:
            return seg
        text = tok.detokenize(seg)
        if flags.fim_no_prefix is not None and text.startswith(flags.fim_no_prefix):
            return seg
        a, b = sorted(rng.randint(0, len(text) + 1, size=2))
        pre, mid, suf = (tok.tokenize_text(x) if x else []
                         for x in (text[:a], text[a:b], text[b:]))
        if rng.binomial(1, flags.fim_spm_rate):
            return [pre_id, suf_id] + suf + [mid_id] + pre + mid
        return [pre_id] + pre + [suf_id] + suf + [mid_id] + mid

    def segment(seg):
        if split is None or split not in seg:
            return perm(seg, flags.fim_rate)
        if rng.binomial(1, flags.fim_rate) == 0:
            return seg
        out = []
        for k, frag in enumerate(split_list(seg, split)):
            out += ([split] if k else []) + (perm(frag, flags.fim_fragment_rate) if frag else [])
        return out

    eod, out = v[flags.fim_eod_token], []
    for k, seg in enumerate(split_list(list(sample), eod)):
        out += ([eod] if k else []) + (segment(seg) if seg else [])
    n = len(sample)
    return out[:n] + [v[flags.fim_pad_token]] * (n - len(out[:n]))


CASES = {
    "psm": dict(fim_rate=1.0, fim_spm_rate=0.0),
    "spm": dict(fim_rate=1.0, fim_spm_rate=1.0),
    "mixed": dict(fim_rate=0.6, fim_spm_rate=0.5),
    "fragments": dict(fim_rate=0.9, fim_spm_rate=0.3, fim_split_sample="<file_sep>",
                      fim_fragment_rate=0.7),
    "no_prefix": dict(fim_rate=1.0, fim_spm_rate=0.5, fim_no_prefix="import"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_samples_equal_a_naive_reimplementation(data_prefix, bpe, case):
    flags = fim_flags(**CASES[case])
    plain, fim = datasets(data_prefix, resolve_fim_config(flags, bpe))
    permuted = 0
    for i in range(len(fim)):
        raw = plain[i]["text"]
        want = naive_fim(raw.tolist(), bpe, flags, sample_rng(1234, i))
        got = fim[i]["text"]
        assert got.dtype == np.int64 and got.shape == raw.shape == (25,)
        assert got.tolist() == want, f"sample {i}"
        permuted += got.tolist() != raw.tolist()
    assert permuted > len(fim) // 3          # the permutation did happen, on many samples


def test_rate_zero_gives_the_plain_samples_bit_for_bit(data_prefix, bpe):
    plain, fim = datasets(data_prefix, resolve_fim_config(fim_flags(fim_rate=0.0), bpe))
    starts_with_eod = 0
    for i in range(len(plain)):
        np.testing.assert_array_equal(fim[i]["text"], plain[i]["text"])
        starts_with_eod += int(plain[i]["text"][0] == bpe.eod)
    assert starts_with_eod                    # the case Megatron-LM's code changes is covered


def test_a_sample_depends_only_on_seed_and_index(data_prefix, bpe):
    config = resolve_fim_config(fim_flags(fim_rate=1.0), bpe)
    _, fim = datasets(data_prefix, config)
    forward = [fim[i]["text"].tolist() for i in range(len(fim))]
    backward = [fim[i]["text"].tolist() for i in reversed(range(len(fim)))][::-1]
    assert forward == backward
    assert fim[-1]["text"].tolist() == forward[-1]
    _, other_seed = datasets(data_prefix, config, seed=99)
    plain_other, _ = datasets(data_prefix, config, seed=99)
    assert [other_seed[i]["text"].tolist() for i in range(len(fim))] != forward
    assert other_seed[0]["text"].tolist() == naive_fim(
        plain_other[0]["text"].tolist(), bpe, fim_flags(fim_rate=1.0), sample_rng(99, 0))


def test_fim_shares_the_plain_datasets_index_cache(data_prefix, bpe):
    cache = os.path.join(os.path.dirname(data_prefix), "cache")
    datasets(data_prefix, None, num_samples=33)
    before = sorted(os.listdir(cache))
    plain, fim = datasets(data_prefix, resolve_fim_config(fim_flags(), bpe), num_samples=33)
    assert sorted(os.listdir(cache)) == before
    assert fim.description == plain.description
    np.testing.assert_array_equal(fim.shuffle_idx, plain.shuffle_idx)


def test_pieces_get_no_begin_token_from_a_hugging_face_post_processor(tmp_path):
    """A tokenizer.json whose post-processor starts every text with <s>: the re-tokenized pieces
    of a permuted sample hold no <s> (Megatron-LM tokenizes them without special tokens)."""
    from tokenizers import AddedToken, processors

    from megatron.tokenizer import gpt2_vocab_files
    from megatron.tokenizer.huggingface import HuggingFaceTokenizer
    from tests.unit.test_tokenizer import byte_level_reference

    hf = byte_level_reference(*gpt2_vocab_files())
    hf.add_special_tokens([AddedToken(x, special=True) for x in
                           ("<s>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")])
    bos = hf.token_to_id("<s>")
    hf.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                      special_tokens=[("<s>", bos)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = HuggingFaceTokenizer(str(tmp_path))
    text = "def area(r):\n    return 3.14 * r * r\n"
    assert tok.tokenize(text)[0] == bos and bos not in tok.tokenize_text(text)
    config = resolve_fim_config(fim_flags(fim_rate=1.0, fim_eod_token="<|endoftext|>"), tok)
    sample = np.array(tok.tokenize_text(text) + [tok.eod], dtype=np.int64)
    for index in range(20):
        got = fim_sample(sample, config, sample_rng(7, index))
        want = naive_fim(sample.tolist(), tok, fim_flags(fim_rate=1.0,
                         fim_eod_token="<|endoftext|>"), sample_rng(7, index))
        assert got.tolist() == want and bos not in want
        assert config.prefix_id in want


def test_the_split_builder_makes_fim_datasets_also_in_blends(data_prefix, bpe):
    from megatron.data.blendable_dataset import BlendableDataset
    from megatron.data.gpt_dataset import build_train_valid_test_datasets

    fim = resolve_fim_config(fim_flags(fim_rate=1.0), bpe)
    base = dict(seed=1234, seq_length=24, split="80,20,0")
    plain_train, _, _ = build_train_valid_test_datasets(GPTDatasetConfig(**base), [data_prefix],
                                                        [10, 4, 0])
    train, valid, test = build_train_valid_test_datasets(GPTDatasetConfig(**base, fim=fim),
                                                         [data_prefix], [10, 4, 0])
    assert isinstance(train, GPTFIMDataset) and isinstance(valid, GPTFIMDataset) and test is None
    assert train[3]["text"].tolist() == naive_fim(plain_train[3]["text"].tolist(), bpe,
                                                  fim_flags(fim_rate=1.0), sample_rng(1234, 3))
    blend, _, _ = build_train_valid_test_datasets(GPTDatasetConfig(**base, fim=fim),
                                                  ["1", data_prefix, "1", data_prefix], [10, 4, 0])
    assert isinstance(blend, BlendableDataset)
    assert all(isinstance(d, GPTFIMDataset) for d in blend.datasets)
    clone = pickle.loads(pickle.dumps(train))                 # loader workers may pickle it
    assert clone[3]["text"].tolist() == train[3]["text"].tolist()


# ------------------------------------------------------------------------------ refusals


def test_a_tokenizer_without_the_fim_tokens_is_refused_in_one_line(tiktoken_vocab):  # noqa
    path, tokens = tiktoken_vocab
    plain = TikTokenizer(path, "v2", vocab_size=16 + len(tokens), num_special_tokens=16)
    with pytest.raises(DataError) as err:
        resolve_fim_config(fim_flags(), plain)
    message = str(err.value)
    assert "\n" not in message
    assert "--fim-prefix-token '<fim_prefix>'" in message and "TikToken" in message


def test_an_unknown_split_token_is_refused(bpe):
    with pytest.raises(DataError, match="--fim-split-sample '<repo_sep>'"):
        resolve_fim_config(fim_flags(fim_split_sample="<repo_sep>", fim_fragment_rate=0.5), bpe)


def test_no_fim_config_without_fim_data(bpe):
    assert resolve_fim_config(FIMFlags(), bpe) is None


MINIMAL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
           "--max-position-embeddings 8 --micro-batch-size 1 --data-path x --fim-data").split()


@pytest.mark.parametrize("extra, match", [
    ("--fim-rate 1.5", "--fim-rate 1.5 is not a probability"),
    ("--fim-spm-rate -0.1", "--fim-spm-rate -0.1 is not a probability"),
    ("--fim-split-sample <sep>", "--fim-split-sample <sep> needs --fim-fragment-rate"),
    ("--mock-data", "--mock-data has no text"),
])
def test_bad_fim_flags_are_refused_before_any_run(extra, match):
    args = parse_args(argv=MINIMAL + extra.split())
    with pytest.raises(ArgumentsError, match=match):
        validate_args(args)


def test_fim_flags_parse_with_megatrons_defaults():
    args = validate_args(parse_args(argv=MINIMAL))
    assert (args.fim_rate, args.fim_spm_rate, args.fim_split_sample, args.fim_fragment_rate,
            args.fim_no_prefix) == (0.5, 0.5, None, None, None)
    assert (args.fim_prefix_token, args.fim_middle_token, args.fim_suffix_token,
            args.fim_pad_token, args.fim_eod_token) == (
        "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>")
