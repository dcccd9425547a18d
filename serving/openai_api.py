"""The OpenAI API's JSON: requests read into the shared GenerateRequest, and the shared events (StepOutput
deltas, Finished) written as chat.completion / text_completion objects and their stream chunks.

Pure functions and small classes, no I/O: http.py does the transport. What the engine cannot do (n > 1,
penalties, logit_bias, tools, echo, suffix, best_of) is refused with a 400 that names the field, rather
than ignored: a client that relies on it would otherwise get a different answer without knowing.
Extensions beyond OpenAI's fields: `top_k`, `ignore_eos` (fixed-length replies, for load tests) and
`return_token_ids` (each choice, and each stream chunk, carries its `token_ids`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Callable

from serving.frontend import Finished, Started
from serving.translate import FieldNames, GenerateRequest, Message
from stratum_jax.request import FinishReason, InvalidRequestError, SamplingParams, StepOutput, TokenLogprob

MAX_COMPLETION_LOGPROBS = SamplingParams.MAX_LOGPROBS   # OpenAI allows 5; the engine gives up to 20
SYSTEM_ROLES = ("system", "developer")                   # "developer" is the newer name of "system"

FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP_TOKEN: "stop", FinishReason.STOP_STRING: "stop",
                  FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}

# Fields whose OpenAI meaning the engine does not implement: name -> the values that mean "not used".
_UNSUPPORTED = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "audio": (None,),
    "prediction": (None,), "modalities": (None, ["text"]),
}


@dataclasses.dataclass(frozen=True)
class Options:
    """How to write the reply: what the OpenAI fields ask beyond the GenerateRequest."""

    chat: bool
    stream: bool = False
    include_usage: bool = False      # stream_options.include_usage: a last chunk with the usage
    logprobs: bool = False
    top_logprobs: int = 0            # alternatives per token (the engine is asked for at least 1: the chosen)
    return_token_ids: bool = False


@dataclasses.dataclass(frozen=True)
class Parsed:
    request: GenerateRequest
    options: Options


# ---------------------------------------------------------------- reading requests

def parse_body(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"the request body is not valid JSON ({e}): send a JSON object") from e
    if not isinstance(data, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    if (where := _lone_surrogate(data, "")) is not None:
        path, char = where
        raise InvalidRequestError(f"{path} holds a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not text: "
                                  "send a high and low surrogate together (\\ud83d\\ude00), or the character itself")
    return data


def _lone_surrogate(value, path: str) -> tuple[str, str] | None:
    """(where, the character) of the first unpaired surrogate in the strings (keys too) of a parsed JSON value, or None.
    JSON's \\uXXXX escapes can name half of a pair, and such a string cannot be encoded for the tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, value[e.start]
    elif isinstance(value, dict):
        for key, item in value.items():
            if found := (_lone_surrogate(key, f"a key of {path or 'the body'}")
                         or _lone_surrogate(item, f"{path}.{key}" if path else key)):
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := _lone_surrogate(item, f"{path}[{i}]"):
                return found
    return None


def _get(body: dict, name: str, kind: str, default=None):
    """body[name] checked to be of `kind` (integer, number, boolean, string, object); null means default."""
    value = body.get(name)
    if value is None:
        return default
    ok = {"integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "boolean": isinstance(value, bool), "string": isinstance(value, str),
          "object": isinstance(value, dict)}[kind]
    if not ok or (kind == "number" and not math.isfinite(value)):
        raise InvalidRequestError(f"{name} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                                  f"got {json.dumps(value)[:80]}")
    return value


def _common(body: dict, chat: bool) -> dict:
    """The fields chat and completions share, checked; keyword arguments of GenerateRequest and Options."""
    n = _get(body, "n", "integer", 1)
    if n != 1:
        raise InvalidRequestError(f"n must be 1: this server returns one choice per request, got n={n}; send "
                                  "n=1 or leave it out (send several requests for several choices)")
    for name, unused in _UNSUPPORTED.items():
        if name in body and body[name] not in unused:
            raise InvalidRequestError(f"{name} is not supported by this server: leave it out")
    response_format = _get(body, "response_format", "object")
    if response_format is not None and response_format.get("type", "text") != "text":
        raise InvalidRequestError("response_format must be {\"type\": \"text\"}: structured output is not supported")
    _get(body, "user", "string")          # accepted (OpenAI's end-user id), not used
    max_tokens = _get(body, "max_tokens", "integer")
    max_completion_tokens = _get(body, "max_completion_tokens", "integer") if chat else None
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise InvalidRequestError(f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion_tokens}) "
                                  "differ: send one of them")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {json.dumps(stop)[:80]}")
    stream = _get(body, "stream", "boolean", False)
    stream_options = _get(body, "stream_options", "object")
    if stream_options is not None and not stream:
        raise InvalidRequestError("stream_options is only allowed with stream: true")
    include_usage = _get(stream_options or {}, "include_usage", "boolean", False)
    seed = _get(body, "seed", "integer")
    if seed is not None and not 0 <= seed < 2**63:
        raise InvalidRequestError(f"seed must be an integer in [0, 2^63), got {seed}")
    model = _get(body, "model", "string", "")
    names = FieldNames(stop="stop", max_tokens="max_completion_tokens" if max_completion_tokens is not None
                       else "max_tokens", system_hint="system messages must come first")
    return dict(
        request=dict(model=model, max_tokens=max_completion_tokens if max_completion_tokens is not None
                     else max_tokens, temperature=_get(body, "temperature", "number"),
                     top_p=_get(body, "top_p", "number"), top_k=_get(body, "top_k", "integer"), seed=seed,
                     stop=tuple(stop), ignore_eos=_get(body, "ignore_eos", "boolean", False), names=names),
        options=dict(chat=chat, stream=stream, include_usage=include_usage,
                     return_token_ids=_get(body, "return_token_ids", "boolean", False)))


def _content(i: int, message: dict) -> str:
    """A message's text: a string, or a list of text parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequestError(f"messages[{i}].content[{j}] must be a text part "
                                          "{\"type\": \"text\", \"text\": \"...\"}: only text is supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts, got "
                              f"{json.dumps(content)[:80]}")


def parse_chat(body: dict) -> Parsed:
    """A /v1/chat/completions body. Leading system (or developer) messages become the system prompt."""
    common = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequestError("messages must be a list of {\"role\": ..., \"content\": ...} objects")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string role")
        turns.append(Message(m["role"], _content(i, m)))
    leading = next((i for i, m in enumerate(turns) if m.role not in SYSTEM_ROLES), len(turns))
    system = "\n\n".join(m.content for m in turns[:leading])
    logprobs = _get(body, "logprobs", "boolean", False)
    top = _get(body, "top_logprobs", "integer", 0)
    if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be an integer in [0, {SamplingParams.MAX_LOGPROBS}], got {top}")
    if top and not logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true")
    names = dataclasses.replace(common["request"].pop("names"), message_offset=leading)
    request = GenerateRequest(messages=tuple(turns[leading:]), system=system, logprobs=max(top, 1) if logprobs else 0,
                              names=names, **common["request"])
    return Parsed(request, Options(logprobs=logprobs, top_logprobs=top, **common["options"]))


def parse_completion(body: dict) -> Parsed:
    """A /v1/completions body: one prompt (a string, or token ids), not chat-templated."""
    common = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]        # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise InvalidRequestError("prompt must be a string or a list of token ids (one prompt: send several "
                                  f"requests for several), got {json.dumps(prompt)[:80]}")
    logprobs = _get(body, "logprobs", "integer")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}")
    request = GenerateRequest(prompt=prompt, logprobs=0 if logprobs is None else max(logprobs, 1),
                              **common["request"])
    return Parsed(request, Options(logprobs=logprobs is not None, top_logprobs=logprobs or 0, **common["options"]))


# ---------------------------------------------------------------- writing replies

def usage(f: Finished) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.output_tokens,
            "total_tokens": f.prompt_tokens + f.output_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_prompt_tokens}}


class Writer:
    """Writes one call's reply: whole (`reply`) or as stream chunks (`first_chunk`, `chunk`, `last_chunks`).

    token_text(id) is the text of one token, for logprobs (the OpenAI API names tokens by their text).
    """

    def __init__(self, options: Options, started: Started, token_text: Callable[[int], str]) -> None:
        self.options = options
        self.token_text = token_text
        self.id = ("chatcmpl-" if options.chat else "cmpl-") + started.request_id
        self.model = started.model
        self.created = int(time.time())
        self.offset = 0      # completions logprobs: text_offset of the next token

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = ("chat.completion" if self.options.chat else "text_completion") + (".chunk" if chunk and
                                                                                   self.options.chat else "")
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if chunk and self.options.include_usage:
            out["usage"] = None      # as OpenAI: null on every chunk but the last
        return out

    def _choice(self, outputs: list[StepOutput], finish: Finished | None, chunk: bool) -> dict:
        text = "".join(o.text_delta for o in outputs)
        choice: dict = {"index": 0}
        if self.options.chat:
            if chunk:
                choice["delta"] = {"content": text} if outputs else {}
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(outputs) if self.options.logprobs else None
        choice["finish_reason"] = None if finish is None else FINISH_REASONS[finish.finish_reason]
        if self.options.return_token_ids:
            choice["token_ids"] = [t for o in outputs for t in o.new_token_ids]
        return choice

    def _logprobs(self, outputs: list[StepOutput]) -> dict:
        entries = [e for o in outputs for e in (o.logprobs or ())]
        top = self.options.top_logprobs
        if self.options.chat:
            return {"content": [dict(self._token(e[0]), top_logprobs=[self._token(t) for t in e[1:1 + top]])
                                for e in entries]}
        tokens = [self.token_text(e[0].token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e[0].logprob for e in entries],
                "top_logprobs": [{self.token_text(t.token_id): t.logprob for t in e[1:1 + top]} for e in entries],
                "text_offset": offsets}

    def _token(self, t: TokenLogprob) -> dict:
        text = self.token_text(t.token_id)
        return {"token": text, "logprob": t.logprob, "bytes": list(text.encode())}

    def reply(self, outputs: list[StepOutput], finish: Finished) -> dict:
        out = self._envelope([self._choice(outputs, finish, chunk=False)], chunk=False)
        out["usage"] = usage(finish)
        return out

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role (and empty content), as OpenAI's do."""
        if not self.options.chat:
            return None
        return self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], chunk=True)

    def chunk(self, out: StepOutput) -> dict:
        return self._envelope([self._choice([out], None, chunk=True)], chunk=True)

    def last_chunks(self, finish: Finished) -> list[dict]:
        """The chunk with the finish reason, then (with include_usage) the usage chunk, which has no choices."""
        chunks = [self._envelope([self._choice([], finish, chunk=True)], chunk=True)]
        if self.options.include_usage:
            chunks.append(dict(self._envelope([], chunk=True), usage=usage(finish)))
        return chunks
