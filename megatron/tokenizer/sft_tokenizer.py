"""Megatron's ``SFTTokenizer``: a local Hugging Face ``tokenizer.json`` plus a prompt format.

A prompt format (``--sft-tokenizer-prompt-format``) turns each turn of a conversation into text
with the format's role markers; the conversation's tokens are the tokens of the concatenated
turns, tokenized without the tokenizer's own begin/end tokens (a chat template writes its special
tokens itself). Tokens of system and user turns (and the assistant header, where a format has one
inside the assistant turn) carry no loss.

Formats built here (their role markers are Megatron-LM's):

``nemotron-h-aligned`` (the default)::

    <SPECIAL_10>System\\n{system}\\n
    <SPECIAL_11>User\\n{user}\\n<SPECIAL_11>Assistant\\n   (the user turn ends with the header)
    {assistant}\\n

    padding ``<SPECIAL_233>``

``nemotron-nano-v2``::

    <SPECIAL_10>System\\n{system without /think, /no_think}\\n
    <SPECIAL_11>User\\n{user without /think, /no_think}\\n
    <SPECIAL_11>Assistant\\n{assistant}\\n<SPECIAL_12>\\n       (its first 3 tokens carry no loss:
                                                      the header, where "Assistant" is one token)

    padding ``<unk>``

Every content is stripped of surrounding whitespace first.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from megatron.tokenizer.base import MegatronTokenizer

ROLES = ("system", "user", "assistant")


def _no_think(text: str) -> str:
    return text.replace("/think", "").replace("/no_think", "").strip()


def _nemotron_h_aligned(role: str, content: str) -> str:
    if role == "system":
        return "<SPECIAL_10>System\n" + content.strip() + "\n"
    if role == "user":
        return "<SPECIAL_11>User\n" + content.strip() + "\n<SPECIAL_11>Assistant\n"
    return content.strip() + "\n"


def _nemotron_nano_v2(role: str, content: str) -> str:
    if role == "system":
        return "<SPECIAL_10>System\n" + _no_think(content) + "\n"
    if role == "user":
        return "<SPECIAL_11>User\n" + _no_think(content) + "\n"
    return "<SPECIAL_11>Assistant\n" + content.strip() + "\n<SPECIAL_12>\n"


@dataclass(frozen=True)
class PromptFormat:
    """How one format writes a turn, which token pads, and how many leading tokens of an
    assistant turn (its header) carry no loss."""
    render_turn: Callable[[str, str], str]
    pad_token: str
    assistant_prefix_len: int


PROMPT_FORMATS: Dict[str, PromptFormat] = {
    "nemotron-h-aligned": PromptFormat(_nemotron_h_aligned, "<SPECIAL_233>", 0),
    "nemotron-nano-v2": PromptFormat(_nemotron_nano_v2, "<unk>", 3),
}


def prompt_format(name: str) -> PromptFormat:
    """The format ``--sft-tokenizer-prompt-format`` names; an unknown one is refused."""
    if name not in PROMPT_FORMATS:
        raise ValueError(f"--sft-tokenizer-prompt-format {name!r} is not built; choose one of "
                         f"{', '.join(PROMPT_FORMATS)}")
    return PROMPT_FORMATS[name]


class TurnBoundaryError(ValueError):
    """The tokens of a turn alone differ from its tokens inside the whole conversation."""


class SFTTokenizer(MegatronTokenizer):
    """``--tokenizer-type SFTTokenizer``: ``--tokenizer-model`` is a local tokenizer.json (or a
    folder holding one) and ``prompt_format`` one of :data:`PROMPT_FORMATS`."""

    def __init__(self, tokenizer_path: str, prompt_format_name: str):
        super().__init__("SFT")
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        self._format = prompt_format(prompt_format_name)
        self.prompt_format = prompt_format_name
        self._hf = HuggingFaceTokenizer(tokenizer_path, include_special_tokens=False)
        vocab = self._hf.vocab
        if self._format.pad_token not in vocab:
            raise ValueError(f"--sft-tokenizer-prompt-format {prompt_format_name}: its padding "
                             f"token {self._format.pad_token!r} is not a token of "
                             f"--tokenizer-model {tokenizer_path!r}")
        self._pad = vocab[self._format.pad_token]

    @property
    def vocab_size(self) -> int:
        return self._hf.vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._hf.vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._hf.inv_vocab

    def tokenize(self, text: str) -> List[int]:
        """Ids of plain text, without a chat template or the tokenizer's begin/end tokens."""
        return self._hf.tokenize_text(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._hf.detokenize(token_ids)

    def render(self, conversation: Sequence[Dict[str, str]]) -> List[str]:
        """The text of each turn in this prompt format."""
        return [self._format.render_turn(turn["role"], turn["content"]) for turn in conversation]

    def tokenize_conversation(self, conversation: Sequence[Dict[str, str]]
                              ) -> Tuple[np.ndarray, np.ndarray]:
        """Tokens of a conversation, and which of them carry loss (1) or not (0).

        The conversation is tokenized whole; each turn is tokenized alone too, to find where it
        begins, and must give the same tokens (a format's markers make turn boundaries token
        boundaries; :class:`TurnBoundaryError` otherwise).
        """
        texts = self.render(conversation)
        tokens = np.array(self.tokenize("".join(texts)), dtype=np.int64)
        trained = np.zeros(tokens.size, dtype=np.int64)
        start = 0
        for turn, text in zip(conversation, texts):
            piece = self.tokenize(text)
            if tokens[start:start + len(piece)].tolist() != piece:
                raise TurnBoundaryError(
                    f"the {turn['role']} turn starting at token {start} tokenizes differently "
                    "alone than inside the conversation")
            if turn["role"] == "assistant":
                trained[start + self._format.assistant_prefix_len:start + len(piece)] = 1
            start += len(piece)
        if start != tokens.size:
            raise TurnBoundaryError(f"the turns hold {start} tokens, the conversation "
                                    f"{tokens.size}")
        return tokens, trained

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def eod(self) -> int:
        return self._hf.eod

    @property
    def eos(self) -> int:
        return self._hf.eod
