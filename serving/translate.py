"""Translation between client requests and the engine's contract (prompt ids, SamplingParams, StepOutput).

Both frontends, gRPC (stratum.v1) and HTTP (the OpenAI API), turn their requests into one `GenerateRequest`
and hand it to the same `Translator`, so the checks, the chat template and the limits are the same for
both. Every check raises InvalidRequestError with a message that names the field (as the client's API
calls it) and says what to send, so a frontend can hand it to the client unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from serving.proto.stratum.v1 import stratum_pb2 as pb
from stratum_jax.request import FinishReason, InvalidRequestError, SamplingParams, StepOutput

ROLES = ("user", "assistant")
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256
MAX_REQUEST_ID_CHARS = 128

STOP_REASONS = {
    FinishReason.EOS: pb.END_TURN,
    FinishReason.STOP_TOKEN: pb.END_TURN,
    FinishReason.STOP_STRING: pb.STOP_SEQUENCE,
    FinishReason.LENGTH: pb.MAX_TOKENS,
    FinishReason.CANCELLED: pb.CANCELLED,
}
STOP_REASON_NAMES = {pb.END_TURN: "end_turn", pb.MAX_TOKENS: "max_tokens", pb.STOP_SEQUENCE: "stop_sequence",
                     pb.CANCELLED: "cancelled"}


class UnknownModelError(InvalidRequestError):
    """The request names a model this server does not serve (gRPC: INVALID_ARGUMENT; HTTP: 404)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The served model's name and the request limits the server enforces."""

    model_name: str
    max_context: int
    max_tokens_cap: int


@dataclasses.dataclass(frozen=True)
class FieldNames:
    """How the client's API names what the Translator checks, so that its error messages name the field the
    client actually sent. The defaults are stratum.v1's."""

    stop: str = "stop_sequences"
    max_tokens: str = "max_tokens"
    system_hint: str = "put a system prompt in the 'system' field"
    message_offset: int = 0     # index of messages[0] in the client's list (system messages taken out before)


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str


class Conversation(Protocol):
    """What the chat template needs; a stratum.v1 request (MessagesRequest, CountTokensRequest,
    CostEstimateRequest) and a GenerateRequest both have it."""

    model: str
    system: str
    messages: Sequence  # of objects with str .role and .content


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One generation request, whatever the frontend. Exactly one of `messages` (chat-templated, with
    `system`) and `prompt` (plain text, or token ids; not templated) is used: `prompt` when it is not None.

    max_tokens None means as many as fit in the context (up to the cap); the HTTP API allows leaving it out.
    """

    messages: Sequence[Message] = ()
    system: str = ""
    prompt: str | Sequence[int] | None = None
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    logprobs: int = 0
    ignore_eos: bool = False
    request_id: str = ""
    names: FieldNames = FieldNames()


def from_proto(request: pb.MessagesRequest) -> GenerateRequest:
    """A stratum.v1 Messages request as a GenerateRequest (optional fields left unset stay None)."""
    return GenerateRequest(
        messages=request.messages, system=request.system, model=request.model, max_tokens=request.max_tokens,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=request.top_p if request.HasField("top_p") else None,
        top_k=request.top_k if request.HasField("top_k") else None,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop_sequences), logprobs=request.logprobs, request_id=request.request_id)


class Translator:
    """Builds engine requests from client requests with the served model's chat template."""

    def __init__(self, tokenizer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def check_model(self, model: str) -> None:
        if model and model != self.limits.model_name:
            raise UnknownModelError(
                f"model {model!r} is not served here: send model {self.limits.model_name!r} or leave it empty")

    def prompt_ids(self, request: Conversation, names: FieldNames = FieldNames()) -> list[int]:
        """The chat-templated prompt of a conversation, checked for shape."""
        self.check_model(request.model)
        if not request.messages:
            raise InvalidRequestError("messages is empty: send at least one message, e.g. "
                                      "{role: 'user', content: 'Hello'}")
        turns = []
        for i, message in enumerate(request.messages, names.message_offset):
            if message.role not in ROLES:
                hint = f" ({names.system_hint})" if message.role == "system" else ""
                raise InvalidRequestError(
                    f"messages[{i}].role is {message.role!r}: it must be 'user' or 'assistant'{hint}")
            turns.append({"role": message.role, "content": message.content})
        ids = list(self.tokenizer.apply_chat_template(turns, system=request.system or None,
                                                      add_generation_prompt=True))
        if not ids:
            raise InvalidRequestError("the prompt is empty after the chat template: send some content")
        return ids

    def plain_prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt of a completion request: its text encoded as is (BOS first, no chat template), or its
        token ids, checked against the vocabulary."""
        self.check_model(request.model)
        prompt = request.prompt
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_bos=True))
        else:
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"prompt has token id {bad}: token ids must be in [0, {vocab})")
        if not ids:
            raise InvalidRequestError("prompt is empty: send some text or token ids")
        return ids

    def check_fits(self, prompt_tokens: int, max_tokens: int, names: FieldNames = FieldNames()) -> None:
        context = self.limits.max_context
        if prompt_tokens >= context:
            raise InvalidRequestError(
                f"the prompt is {prompt_tokens} tokens, over this server's context of {context} tokens "
                f"(prompt + {names.max_tokens}): shorten the prompt")
        if prompt_tokens + max_tokens > context:
            raise InvalidRequestError(
                f"the prompt ({prompt_tokens} tokens) + {names.max_tokens} ({max_tokens}) is over this server's "
                f"context of {context} tokens: lower {names.max_tokens} to at most {context - prompt_tokens} "
                f"or shorten the prompt")

    def check_max_tokens(self, max_tokens: int, names: FieldNames = FieldNames()) -> None:
        if max_tokens <= 0:
            raise InvalidRequestError(f"{names.max_tokens} must be a positive integer, got {max_tokens}")
        if max_tokens > self.limits.max_tokens_cap:
            raise InvalidRequestError(
                f"{names.max_tokens}={max_tokens} is over this server's cap of {self.limits.max_tokens_cap}: "
                f"lower it")

    def sampling_params(self, request: GenerateRequest, max_tokens: int) -> SamplingParams:
        names = request.names
        self.check_max_tokens(max_tokens, names)
        stops = tuple(request.stop)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(f"{names.stop} has {len(stops)} entries: send at most {MAX_STOP_SEQUENCES}")
        for i, stop in enumerate(stops):
            if not stop or len(stop) > MAX_STOP_SEQUENCE_CHARS:
                raise InvalidRequestError(
                    f"{names.stop}[{i}] must be 1 to {MAX_STOP_SEQUENCE_CHARS} characters long, got {len(stop)}")
        defaults = SamplingParams()

        def given(value, default):
            return default if value is None else value

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=given(request.temperature, defaults.temperature),
            top_p=given(request.top_p, defaults.top_p),
            top_k=given(request.top_k, defaults.top_k),
            seed=request.seed,
            stop_strings=stops,
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs,
        )
        params.validate(max_tokens_cap=self.limits.max_tokens_cap)
        return params

    def generate_request(self, request: GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Validates a request whole; returns the prompt ids and sampling parameters."""
        check_request_id(request.request_id)
        names = request.names
        if request.max_tokens is not None:   # cheap checks first, before tokenizing
            params = self.sampling_params(request, request.max_tokens)
        if request.prompt is not None:
            ids = self.plain_prompt_ids(request)
        else:
            ids = self.prompt_ids(request, names)
        if request.max_tokens is None:       # as many as fit; a prompt that fills the context is still an error
            params = self.sampling_params(
                request, max(1, min(self.limits.max_tokens_cap, self.limits.max_context - len(ids))))
        self.check_fits(len(ids), params.max_tokens, names)
        return ids, params

    def messages_request(self, request: pb.MessagesRequest) -> tuple[list[int], SamplingParams]:
        """Validates a stratum.v1 Messages request whole; returns the prompt ids and sampling parameters."""
        return self.generate_request(from_proto(request))


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS or not all(33 <= ord(c) < 127 for c in request_id):
        raise InvalidRequestError(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces")


def delta_event(out: StepOutput) -> pb.MessagesEvent | None:
    """The ContentDelta of one step's output, or None when the step produced nothing to send."""
    if not out.new_token_ids and not out.text_delta:
        return None
    delta = pb.ContentDelta(text=out.text_delta, token_ids=out.new_token_ids)
    for entries in out.logprobs or ():
        chosen, top = entries[0], entries[1:]
        delta.logprobs.add(token_id=chosen.token_id, logprob=chosen.logprob,
                           top=[pb.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in top])
    return pb.MessagesEvent(delta=delta)
