"""The embedded trained model `pydoc-2m`: what ships, and that the default generation is English text.

The word check: a whitespace-separated token counts as a word when, stripped of surrounding
punctuation, it is alphabetic and its lowercase form is in tests/data/pydoc_words.txt (every word seen
at least 3 times in the training split, written by training/lm_corpus.py). Markup such as
:func:`len` is not a word. The random `tiny` preset must fail the same check, so the check can fail.
"""

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import jax
import pytest

from stratum_jax import generate
from stratum_jax.config import RuntimeConfig
from stratum_jax.model.loader import EMBEDDED, load_model

ROOT = Path(__file__).resolve().parents[1]
WORDS = frozenset((Path(__file__).parent / "data" / "pydoc_words.txt").read_text().split())
PROMPT = "Python is a programming language that"  # the prompt of `bash .ci/dev generate`
# Greedy output of the committed checkpoint on CPU (bf16, reference attention), 48 tokens.
GOLDEN = (" is a\n:term:`mapping` type, which is a Python object, which is used to\nautomatically control the "
          "language.  The :mod:`gc` module is a\npart of the language, which is")
PUNCT = ".,;:!?()[]{}\"'`*-"


def word_fraction(text: str) -> float:
    """Share of whitespace-separated tokens that are corpus words (0.0 for empty text)."""
    tokens = text.split()
    words = [t.strip(PUNCT) for t in tokens]
    return sum(w.isalpha() and w.lower() in WORDS for w in words) / max(1, len(tokens))


def _generate(capsys, *model_flags: str) -> str:
    rc = generate.main([*model_flags, "--prompt", PROMPT, "--max-tokens", "48", "--max-context", "256",
                        "--kv-pool-tokens", "1024", "--json"])
    assert rc == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]


def test_default_model_is_pydoc_2m():
    assert RuntimeConfig().model == "pydoc-2m"


def test_default_generation_is_english_words_and_golden(capsys):
    text = _generate(capsys)  # no --model: the default
    assert len(text.split()) >= 20
    assert word_fraction(text) >= 0.7, text
    assert text == GOLDEN


def test_word_check_rejects_the_random_model(capsys):
    text = _generate(capsys, "--model", "tiny")
    assert word_fraction(text) < 0.3, text


def test_word_fraction_counts_markup_and_unknown_words_as_non_words():
    assert word_fraction("The list, (and) the tuple.") == 1.0
    assert word_fraction(":func:`len` returns zzqx 3") == pytest.approx(1 / 4)


def test_shipped_checkpoint_shape_and_size():
    d = EMBEDDED["pydoc-2m"]
    assert (d / "model.safetensors").stat().st_size < 5_000_000
    model = load_model("pydoc-2m")
    cfg = model.config
    assert cfg.head_dim == 64 and cfg.dtype == "bfloat16" and cfg.max_position_embeddings >= 1024
    n = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    assert n == cfg.num_params and 2_000_000 < n < 2_500_000
    assert model.tokenizer.vocab_size == cfg.vocab_size
    assert model.tokenizer.chat_template and model.tokenizer.bos_token_id == 0


def test_checkpoint_is_package_data():
    """setuptools installs only files matched by [tool.setuptools.package-data]; every file must be."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    pkg_dir = ROOT / "stratum_jax" / "model"
    for f in EMBEDDED["pydoc-2m"].iterdir():
        rel = f.relative_to(pkg_dir).as_posix()
        assert any(fnmatch(rel, p) for p in patterns.get("stratum_jax.model", [])), rel
