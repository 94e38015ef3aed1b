"""TikTokenizer ids against Megatron-Core's own tiktoken tokenizer (slow: the ``megatron-core``
release's environment of ``test_megatron_core.py``, built once; PyPI is needed to build it).

That environment does not install ``tiktoken``; this interpreter's copy (the same Python) is put
on its import path. Megatron-Core builds its tokenizer from a namespace of Megatron's flags with
its own ``build_tokenizer``, on the same vocabulary file, and tokenizes the same texts.
"""

import importlib.util
import json
import os
import subprocess

import pytest

from megatron.tokenizer import build_tokenizer
from tests.interop.test_megatron_core import mcore_python  # noqa: F401  (fixture)
from tests.unit.test_tokenizer import (TRICKY_TEXTS, gpt2_ranks, namespace,  # noqa: F401
                                       stdlib_texts, tiktoken_vocab)

pytestmark = pytest.mark.slow

MCORE_SCRIPT = r"""
import argparse, json, sys
from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
request = json.load(open(sys.argv[1]))
args = argparse.Namespace(tokenizer_type="TikTokenizer", tokenizer_metadata=None,
                          **request["flags"])
tokenizer = build_tokenizer(args)
inner = tokenizer._tokenizer
json.dump({"ids": [tokenizer.tokenize(t) for t in request["texts"]],
           "vocab_size": tokenizer.vocab_size,
           "special": [inner.bos_id, inner.eos_id, inner.eod, inner.pad_id, inner.unk_id]},
          open(sys.argv[2], "w"))
"""


def _shim(tmp_path) -> str:
    """A folder that makes this interpreter's tiktoken (and regex, which it needs) importable."""
    shim = tmp_path / "shim"
    shim.mkdir()
    for name in ("tiktoken", "tiktoken_ext", "regex"):
        spec = importlib.util.find_spec(name)
        os.symlink(list(spec.submodule_search_locations)[0], shim / name)
    return str(shim)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_ids_equal_megatron_cores(tmp_path, mcore_python, tiktoken_vocab,  # noqa: F811
                                  stdlib_texts, pattern):  # noqa: F811
    path, tokens = tiktoken_vocab
    flags = dict(tokenizer_model=path, tiktoken_pattern=pattern, vocab_size=1000 + len(tokens),
                 tiktoken_num_special_tokens=1000, tokenizer_special_tokens=None)
    texts = stdlib_texts + TRICKY_TEXTS + ["<s>user</s><pad>"]
    request, answer = tmp_path / "request.json", tmp_path / "answer.json"
    request.write_text(json.dumps({"flags": flags, "texts": texts}))
    env = dict(os.environ, PYTHONPATH=_shim(tmp_path))
    result = subprocess.run([str(mcore_python), "-c", MCORE_SCRIPT, str(request), str(answer)],
                            capture_output=True, text=True, env=env, timeout=300,
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(answer.read_text())
    ours = build_tokenizer(namespace(tokenizer_type="TikTokenizer", tokenizer_model=path,
                                     tiktoken_pattern=pattern, vocab_size=1000 + len(tokens),
                                     tiktoken_num_special_tokens=1000, special_tokens=None))
    assert theirs["vocab_size"] == ours.vocab_size
    assert theirs["special"] == [ours.bos, ours.eos, ours.eod, ours.pad, ours.unk]
    for text, ids in zip(texts, theirs["ids"]):
        assert ours.tokenize(text) == ids, text[:60]
