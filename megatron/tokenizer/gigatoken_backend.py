"""``--use-gigatoken``: a HuggingFaceTokenizer's tokenizer.json encoded by the gigatoken package.

gigatoken is a compiled BPE encoder (``pip install gigatoken``; optional, not a runtime
requirement). Megatron hands its Hugging Face tokenizers to it for faster encoding with the same
ids; here the same ``tokenizer.json`` the ``tokenizers`` library reads is loaded into gigatoken's
transformers-compatible wrapper, which encodes, while decoding, the vocabulary and the special
tokens stay on the ``tokenizers`` side.

gigatoken refuses many tokenizer.json settings it cannot reproduce (other normalisers, unknown
split regexes, WordPiece or Unigram models), but some it ignores without a word, so that ids
would silently differ; those are refused here, by :func:`check_tokenizer_json`:

* ``model.dropout`` (BPE dropout), ``model.continuing_subword_prefix``,
  ``model.end_of_word_suffix``;
* added tokens with ``single_word``;
* a ``truncation`` or ``padding`` block;
* a byte-level model (no ``byte_fallback``) whose pre-tokenizer is not ``ByteLevel`` with its
  regex, nor a ``Sequence`` of ``Split`` steps ending in ``ByteLevel`` (GPT-2, Llama-3, Qwen):
  gigatoken splits the text as GPT-2 does whatever the file says.

As a last guard the loaded encoder must give the ``tokenizers`` library's ids on a fixed probe
text (code, several scripts, whitespace runs, and every added token's text).

Megatron applies the flag to its Hugging Face tokenizers only, and so does this project. Not to
TikTokenizer: gigatoken loads tiktoken vocabularies only with its own named split schemes, none
of them stated to be Megatron's ``--tiktoken-pattern`` v1 or v2, and the ids could not be shown
equal.
"""

import importlib
import importlib.util
import json
from typing import Dict, List, Optional

INSTALL_HINT = "pip install gigatoken"

# Text on which the gigatoken encoder must agree with the tokenizers library before it is used.
_PROBE_TEXT = (
    "def tokenize(text: str) -> list[int]:\n"
    "    \"\"\"It's a probe; we've 3 cases, they'll pass.\"\"\"\n"
    "\treturn [ord(c) for c in text]  # 1234567 3.14159 -42\n\n\n"
    "   leading   and trailing spaces   \r\n"
    "café naïve Ω≈ç√ 日本語のテキスト 한국어 русский текст ﬁ e\u0301 \u00a0 🙂👍🏽\n"
    "CamelCaseWord HTTPServer snake_case_name x=y+z**2\n"
)


def gigatoken_refusal(tokenizer_type: Optional[str]) -> Optional[str]:
    """One line saying why ``--use-gigatoken`` cannot run with ``tokenizer_type``, or None.

    Checked before any process group exists (training) or any file is read (preprocessing).
    """
    if tokenizer_type != "HuggingFaceTokenizer":
        reason = (" (gigatoken has no loader for Megatron's tiktoken JSON with --tiktoken-pattern "
                  "v1/v2, so the ids could not be shown equal)"
                  if tokenizer_type == "TikTokenizer" else "")
        return (f"--use-gigatoken applies to --tokenizer-type HuggingFaceTokenizer only, got "
                f"--tokenizer-type {tokenizer_type}{reason}; drop --use-gigatoken")
    if importlib.util.find_spec("gigatoken") is None:
        return (f"--use-gigatoken needs the gigatoken package, which is not installed: "
                f"{INSTALL_HINT} (or drop --use-gigatoken)")
    return None


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"--use-gigatoken: {path}: {what}, a setting gigatoken ignores (its ids "
                      "would differ from the tokenizers library's); drop --use-gigatoken")


def _byte_level_splits(pre_tokenizer: Optional[Dict]) -> bool:
    """Whether a byte-level model's pre-tokenizer is one gigatoken follows: ``ByteLevel`` with
    its GPT-2 regex, or ``Split`` steps then ``ByteLevel`` without one."""
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return bool(pre_tokenizer.get("use_regex", True))
    if pre_tokenizer.get("type") != "Sequence":
        return False
    steps = pre_tokenizer.get("pretokenizers") or []
    return (len(steps) >= 2 and steps[-1].get("type") == "ByteLevel"
            and all(step.get("type") == "Split" for step in steps[:-1]))


def check_tokenizer_json(path: str, config: Dict) -> None:
    """Raise a one-line ValueError naming ``path`` and the setting when ``config`` (the parsed
    tokenizer.json) holds one that gigatoken would ignore (see the module docstring)."""
    model = config.get("model") or {}
    if model.get("dropout"):
        raise _refuse(path, f"model.dropout is {model['dropout']}")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise _refuse(path, f"model.{key} is {model[key]!r}")
    for key in ("truncation", "padding"):
        if config.get(key):
            raise _refuse(path, f"it sets {key}")
    single = [t.get("content") for t in config.get("added_tokens") or [] if t.get("single_word")]
    if single:
        raise _refuse(path, f"the added token {single[0]!r} is single_word")
    if not model.get("byte_fallback") and not _byte_level_splits(config.get("pre_tokenizer")):
        shown = json.dumps(config.get("pre_tokenizer"))
        raise _refuse(path, f"its pre_tokenizer {shown[:120]} is not ByteLevel (nor Split "
                      "steps then ByteLevel)")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_gigatoken(path: str, reference, add_special_tokens: bool):
    """gigatoken's transformers-compatible encoder for the tokenizer.json at ``path``.

    Args:
        path: the tokenizer.json (its bytes are handed over: gigatoken never looks it up on the
            Hugging Face Hub).
        reference: the ``tokenizers.Tokenizer`` read from the same file; the encoder must
            give its ids on the probe text.
        add_special_tokens: whether encoding adds the post-processor's tokens (a BOS, ...).

    Raises:
        ImportError: one line naming the flag and ``pip install gigatoken``.
        ValueError: one line naming ``path`` when gigatoken cannot take the file.
    """
    try:
        gigatoken = importlib.import_module("gigatoken")
    except ImportError:
        raise ImportError(f"--use-gigatoken needs the gigatoken package, which is not "
                          f"installed: {INSTALL_HINT} (or drop --use-gigatoken)") from None
    with open(path, "rb") as f:
        data = f.read()
    try:
        encoder = gigatoken.Tokenizer.from_json(data).as_hf()
    except BaseException as err:  # the compiled loader raises pyo3 panics, not Exceptions
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"--use-gigatoken: gigatoken cannot load {path}: "
                         f"{_first_line(err)}; drop --use-gigatoken") from None
    config = json.loads(data)
    check_tokenizer_json(path, config)
    if add_special_tokens:
        try:
            encoder.num_special_tokens_to_add()  # refuses a post-processor it cannot apply
        except ValueError:
            kind = (config.get("post_processor") or {}).get("type")
            raise ValueError(f"--use-gigatoken: gigatoken cannot add the tokens of the {kind} "
                             f"post_processor of {path}; drop --use-gigatoken (or pass "
                             "--tokenizer-hf-no-include-special-tokens where those tokens are "
                             "not wanted)") from None
    _check_probe(path, encoder, reference, add_special_tokens)
    return encoder


def _check_probe(path: str, encoder, reference, add_special_tokens: bool) -> None:
    added = [t.content for t in reference.get_added_tokens_decoder().values()]
    text = _PROBE_TEXT + " ".join(added) + "x".join(added)
    expected: List[int] = reference.encode(text, add_special_tokens=add_special_tokens).ids
    got = encoder.encode(text, add_special_tokens=add_special_tokens)
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                  min(len(got), len(expected)))
        raise ValueError(f"--use-gigatoken: {path}: gigatoken encodes a probe text differently "
                         f"from the tokenizers library (token {at}: {got[at:at + 1]} instead of "
                         f"{expected[at:at + 1]}); drop --use-gigatoken")
