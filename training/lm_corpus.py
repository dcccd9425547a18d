"""Prepares the corpus of the embedded `pydoc-2m` model: text, held-out split, BPE tokenizer, token ids.

Corpus: the reStructuredText sources of the Python 3.11 documentation as Debian ships them in the
package `python3.11-doc` (version 3.11.2-6+deb12u8, files /usr/share/doc/python3.11/html/_sources/**/*.rst.txt,
497 files, about 12 MB). Licence: the Python documentation is under the PSF License Version 2 (its code
examples also under the Zero-Clause BSD licence); see /usr/share/doc/python3.11-doc/copyright in the
package. Get it without installing anything:

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb pydoc

The held-out split is whole files (every file whose path hashes into the last 5% of a sha256 range),
so no evaluation text is a near-copy of a training window.

    python -m training.lm_corpus --sources pydoc/usr/share/doc/python3.11/html/_sources --out runs/lm-data

writes to OUT: tokenizer.json, tokenizer_config.json (special tokens and the chat template),
train.npy / val.npy (uint16 token ids, each file as <|bos|> text <|eos|>), words.txt (the lowercase
alphabetic words seen at least 3 times in the training split) and corpus.json (sizes and sources).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
from pathlib import Path

import numpy as np

VOCAB_SIZE = 4096
HELD_OUT_FRACTION = 0.05
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]  # ids 0..6, in this order

# Each turn: <|role|>\n content <|end|>\n; a generation prompt opens an assistant turn. The model was
# trained on documentation only, never on conversations: the template exists so that chat requests
# render, not because the model follows turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

WORD_RE = re.compile(r"[A-Za-z]+")
MIN_WORD_COUNT = 3


def is_held_out(rel_path: str) -> bool:
    """Deterministic file-level split: the path's sha256, as a fraction of its range, >= 1 - 5%."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 >= 1 - HELD_OUT_FRACTION


def read_sources(sources: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """-> (train, val): lists of (relative path, text), sorted by path."""
    files = sorted(sources.rglob("*.rst.txt"))
    if not files:
        raise SystemExit(f"{sources}: no *.rst.txt files; give the _sources folder of python3.11-doc")
    train, val = [], []
    for f in files:
        rel = f.relative_to(sources).as_posix()
        (val if is_held_out(rel) else train).append((rel, f.read_text(encoding="utf-8")))
    return train, val


def train_tokenizer(texts: list[str]):
    """A byte-level BPE of VOCAB_SIZE tokens (special tokens first) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # transformers adds BOS through the post-processor; the runtime's HFTokenizer adds it itself (and
    # encodes with add_special_tokens=False), so both turn a prompt into the same ids.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))])
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def encode_files(tok, texts: list[str]) -> np.ndarray:
    """Each text as [bos] ids [eos], concatenated -> uint16 [N]."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out += [bos, *enc.ids, eos]
    return np.asarray(out, np.uint16)


def word_list(texts: list[str]) -> list[str]:
    counts = collections.Counter(w.lower() for t in texts for w in WORD_RE.findall(t))
    return sorted(w for w, c in counts.items() if c >= MIN_WORD_COUNT)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=Path, required=True, help="the _sources folder of python3.11-doc")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    train, val = read_sources(args.sources)
    train_texts, val_texts = [t for _, t in train], [t for _, t in val]
    tok = train_tokenizer(train_texts)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    train_ids, val_ids = encode_files(tok, train_texts), encode_files(tok, val_texts)
    np.save(args.out / "train.npy", train_ids)
    np.save(args.out / "val.npy", val_ids)
    words = word_list(train_texts)
    (args.out / "words.txt").write_text("\n".join(words) + "\n")
    info = {
        "source": "Debian package python3.11-doc 3.11.2-6+deb12u8, /usr/share/doc/python3.11/html/_sources",
        "licence": "PSF License Version 2 (Python documentation); examples also Zero-Clause BSD",
        "train_files": len(train), "val_files": len(val), "val_file_names": [p for p, _ in val],
        "train_bytes": sum(len(t.encode()) for t in train_texts), "val_bytes": sum(len(t.encode()) for t in val_texts),
        "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size), "vocab_size": tok.get_vocab_size(),
        "words": len(words),
    }
    (args.out / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "val_file_names"}, indent=2))


if __name__ == "__main__":
    main()
