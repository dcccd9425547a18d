"""Tokenizers: HF `tokenizer.json` (through the `tokenizers` library), a byte-level fallback, and an
incremental detokenizer that turns a token stream into stable text deltas.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

# Used when a tokenizer has no chat template of its own. Each turn is "<role>: <content>\n";
# a generation prompt appends "assistant:". Roles are the messages' own ("system", "user", ...).
FALLBACK_CHAT_FORMAT = "{role}: {content}\n"
FALLBACK_GENERATION_PROMPT = "assistant:"


class Tokenizer:
    """The interface the engine and the server use.

    encode(text, add_bos) -> ids, with BOS prepended only when add_bos and the tokenizer has one;
    decode(ids) -> text, special tokens (BOS/EOS/...) left out.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def _special_strings(self) -> dict[str, str]:
        """Variables a chat template may reference (bos_token, eos_token)."""
        return {}

    def apply_chat_template(self, messages: list[dict], system: str | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Renders a conversation to prompt ids.

        messages: [{"role": "user" | "assistant" | ..., "content": str}, ...]; `system`, if given, is put
        first as a {"role": "system"} message. With a chat template (HF jinja, rendered like
        transformers does) the rendered text is encoded without adding BOS, since templates write it
        themselves. Without one the fallback format is "<role>: <content>\\n" per message, then
        "assistant:" when add_generation_prompt, encoded with BOS.
        """
        msgs = ([{"role": "system", "content": system}] if system is not None else []) + list(messages)
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"chat messages need a str 'role' and a str 'content', got {m!r}")
        if self.chat_template is None:
            text = "".join(FALLBACK_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in msgs)
            if add_generation_prompt:
                text += FALLBACK_GENERATION_PROMPT
            return self.encode(text, add_bos=True)
        text = _compile_template(self.chat_template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **self._special_strings())
        return self.encode(text, add_bos=False)


class ByteTokenizer(Tokenizer):
    """ids 0..255 are the UTF-8 bytes; then <bos>=256, <eos>=257, <pad>=258.

    vocab_size is max(259, vocab_size): a model's larger vocabulary is padding that never decodes.
    eos_token_ids: the ids that end generation; a checkpoint that names its own EOS passes them (its 257 may
    be an ordinary token), else <eos>=257.
    """

    BOS, EOS, PAD = 256, 257, 258

    def __init__(self, vocab_size: int = 259, eos_token_ids: tuple[int, ...] = ()):
        self.vocab_size = max(259, vocab_size)
        self.bos_token_id = self.BOS
        self.eos_token_ids = tuple(eos_token_ids) or (self.EOS,)
        self.pad_token_id = self.PAD

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """An HF tokenizer directory: tokenizer.json, plus tokenizer_config.json (special tokens, chat
    template), chat_template.jinja (transformers 5 stores the template there), generation_config.json
    and config.json (EOS ids). Only tokenizer.json is required.

    encode(add_bos=True) prepends BOS unless tokenizer_config.json says "add_bos_token": false.
    """

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer as _RustTokenizer

        d = Path(directory)
        self._tok = _RustTokenizer.from_file(str(d / "tokenizer.json"))
        tok_cfg = _read_json(d / "tokenizer_config.json")
        gen_cfg = _read_json(d / "generation_config.json")
        model_cfg = _read_json(d / "config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        self._specials = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            tok = tok_cfg.get(name)
            if isinstance(tok, dict):  # the AddedToken form {"content": ...}
                tok = tok.get("content")
            if isinstance(tok, str):
                self._specials[name] = tok

        def special_id(name: str) -> int:
            """The id of the special token tokenizer_config.json names; an unknown one would silently drop
            BOS from every prompt (or never stop at EOS)."""
            token_id = self._tok.token_to_id(self._specials[name])
            if token_id is None:
                raise ValueError(f"{d / 'tokenizer_config.json'}: {name} {self._specials[name]!r} is not in the "
                                 f"vocabulary of {d / 'tokenizer.json'}; fix the one or the other")
            return token_id

        # tokenizer_config.json decides BOS when present (Qwen2's config.json names a bos_token_id that its
        # tokenizer never adds); otherwise the model's configs do.
        self._add_bos = tok_cfg.get("add_bos_token", True) is not False
        if tok_cfg:
            bos = None
            if "bos_token" in self._specials:  # one that is never added may be unknown
                bos = special_id("bos_token") if self._add_bos else self._tok.token_to_id(self._specials["bos_token"])
        else:
            bos = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
        self.bos_token_id = bos
        # generation_config.json lists every stop id (Llama 3.1: <|end_of_text|>, <|eom_id|>, <|eot_id|>).
        eos = gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id"))
        if eos is None and "eos_token" in self._specials:
            eos = special_id("eos_token")
        self.eos_token_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None)

        template, source = tok_cfg.get("chat_template"), d / "tokenizer_config.json"
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            if not all(isinstance(t, dict) for t in template):
                raise ValueError(f"{source}: chat_template list entries must be {{\"name\", \"template\"}} objects, "
                                 f"got {json.dumps(template)}")
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            source = d / "chat_template.jinja"
            try:
                template = source.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{source}: not UTF-8 text (byte {e.start}); it must be a jinja template") from e
        if template is not None:
            _check_template(template, source)
        self.chat_template = template

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # add_special_tokens=False: BOS is ours to add (tokenizer.json post-processors add it too).
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = add_bos and self._add_bos and self.bos_token_id is not None
        return ([self.bos_token_id] if bos else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def _special_strings(self) -> dict[str, str]:
        return dict(self._specials)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that never change once emitted.

    Decoding token by token is wrong for byte-level BPE (a character split over tokens) and for
    SentencePiece (a token's leading space depends on its left neighbour), so each step decodes a
    short window of already-emitted context plus the new tokens and emits the difference. A delta that
    ends in U+FFFD (an incomplete UTF-8 sequence) is held back until later tokens complete it.
    prompt_ids give the first generated token its left context; their text is not emitted.
    """

    _CONTEXT = 6  # tokens of left context re-decoded with each step

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = ()):
        self._tok = tokenizer
        self._ids = list(prompt_ids)
        self._prefix = max(0, len(self._ids) - self._CONTEXT)  # start of the re-decoded window
        self._read = len(self._ids)  # ids before this are already emitted (or are the prompt)
        self.text = ""

    def _pending(self) -> str:
        context = self._tok.decode(self._ids[self._prefix:self._read])
        full = self._tok.decode(self._ids[self._prefix:])
        # full normally extends context; if a decoder rewrote the context, emit only what is new in length.
        return full[len(context):]

    def push(self, token_id: int) -> str:
        """Adds one token; returns the newly stable text ("" while it is held back)."""
        self._ids.append(token_id)
        delta = self._pending()
        if not delta or delta.endswith("\ufffd"):
            return ""
        self._prefix = max(self._prefix, self._read - self._CONTEXT)
        self._read = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emits whatever is held back (incomplete UTF-8 becomes U+FFFD); call at end of stream."""
        delta = self._pending()
        self._prefix = max(self._prefix, self._read - self._CONTEXT)
        self._read = len(self._ids)
        self.text += delta
        return delta


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); it must be a JSON file") from e
    if not isinstance(content, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(content).__name__}")
    return content


def _check_template(template, source: Path) -> None:
    """A chat template that is not a string, or not valid jinja, fails at load, naming its file, rather
    than on every chat request."""
    import jinja2

    if not isinstance(template, str):
        raise ValueError(f"{source}: chat_template must be a string (or a list of {{\"name\", \"template\"}} "
                         f"objects), got {json.dumps(template)}")
    try:
        _compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source}: chat template is not valid jinja (line {e.lineno}: {e.message})") from e


_TEMPLATES: dict[str, object] = {}


def _compile_template(source: str):
    """Compiles an HF chat template with the environment transformers uses (sandboxed, trim_blocks,
    lstrip_blocks, loopcontrols, raise_exception, strftime_now, a tojson that does not HTML-escape)."""
    if source not in _TEMPLATES:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
