"""Translation between stratum.v1 messages and the engine's contract (prompt ids, SamplingParams, StepOutput).

Every check here raises InvalidRequestError with a message that names the field and says what to send,
so the servicer can hand it to the client as INVALID_ARGUMENT unchanged.
"""
from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Limits:
    """The served model's name and the request limits the server enforces."""

    model_name: str
    max_context: int
    max_tokens_cap: int


class Translator:
    """Builds engine requests from stratum.v1 requests with the served model's chat template."""

    def __init__(self, tokenizer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def prompt_ids(self, request) -> list[int]:
        """The chat-templated prompt of a Messages/CountTokens/CostEstimate request, checked for shape."""
        if request.model and request.model != self.limits.model_name:
            raise InvalidRequestError(
                f"model {request.model!r} is not served here: send model {self.limits.model_name!r} or leave it empty")
        if not request.messages:
            raise InvalidRequestError("messages is empty: send at least one message, e.g. "
                                      "{role: 'user', content: 'Hello'}")
        turns = []
        for i, message in enumerate(request.messages):
            if message.role not in ROLES:
                hint = " (put a system prompt in the 'system' field)" if message.role == "system" else ""
                raise InvalidRequestError(
                    f"messages[{i}].role is {message.role!r}: it must be 'user' or 'assistant'{hint}")
            turns.append({"role": message.role, "content": message.content})
        ids = list(self.tokenizer.apply_chat_template(turns, system=request.system or None,
                                                      add_generation_prompt=True))
        if not ids:
            raise InvalidRequestError("the prompt is empty after the chat template: send some content")
        return ids

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        context = self.limits.max_context
        if prompt_tokens >= context:
            raise InvalidRequestError(
                f"the prompt is {prompt_tokens} tokens, over this server's context of {context} tokens "
                f"(prompt + max_tokens): shorten the messages")
        if prompt_tokens + max_tokens > context:
            raise InvalidRequestError(
                f"the prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) is over this server's context "
                f"of {context} tokens: lower max_tokens to at most {context - prompt_tokens} or shorten the messages")

    def check_max_tokens(self, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {max_tokens}")
        if max_tokens > self.limits.max_tokens_cap:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} is over this server's cap of {self.limits.max_tokens_cap}: lower it")

    def sampling_params(self, request: pb.MessagesRequest) -> SamplingParams:
        self.check_max_tokens(request.max_tokens)
        stops = tuple(request.stop_sequences)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(f"stop_sequences has {len(stops)} entries: send at most {MAX_STOP_SEQUENCES}")
        for i, stop in enumerate(stops):
            if not stop or len(stop) > MAX_STOP_SEQUENCE_CHARS:
                raise InvalidRequestError(
                    f"stop_sequences[{i}] must be 1 to {MAX_STOP_SEQUENCE_CHARS} characters long, got {len(stop)}")
        defaults = SamplingParams()
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature if request.HasField("temperature") else defaults.temperature,
            top_p=request.top_p if request.HasField("top_p") else defaults.top_p,
            top_k=request.top_k if request.HasField("top_k") else defaults.top_k,
            seed=request.seed if request.HasField("seed") else None,
            stop_strings=stops,
            logprobs=request.logprobs,
        )
        params.validate(max_tokens_cap=self.limits.max_tokens_cap)
        return params

    def messages_request(self, request: pb.MessagesRequest) -> tuple[list[int], SamplingParams]:
        """Validates a Messages request whole; returns the prompt ids and sampling parameters."""
        check_request_id(request.request_id)
        params = self.sampling_params(request)   # cheap checks first, before tokenizing
        ids = self.prompt_ids(request)
        self.check_fits(len(ids), params.max_tokens)
        return ids, params


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
