"""The OpenAI API's JSON <-> the shared GenerateRequest / events (serving/openai_api.py), without a server."""
from __future__ import annotations

import dataclasses

import pytest

from serving import openai_api
from serving.frontend import Finished, Started
from serving.translate import Limits, Translator
from stratum_jax.request import FinishReason, InvalidRequestError, SamplingParams, StepOutput, TokenLogprob


class ByteTemplate:
    """One token per byte of "role: content\\n" lines, BOS = 0 for plain prompts."""

    vocab_size = 259

    def apply_chat_template(self, messages, system=None, add_generation_prompt=True):
        text = (f"system: {system}\n" if system else "") + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return list((text + ("assistant: " if add_generation_prompt else "")).encode())

    def encode(self, text, add_bos=True):
        return [0] * add_bos + list(text.encode())


TRANSLATOR = Translator(ByteTemplate(), Limits("tiny", max_context=100, max_tokens_cap=50))


def test_chat_system_messages_and_text_parts_become_the_shared_request():
    parsed = openai_api.parse_chat({
        "model": "tiny", "max_completion_tokens": 5, "temperature": 0, "top_k": 3, "seed": 7, "stop": "\n",
        "messages": [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
                     {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
        "logprobs": True, "stream": True, "stream_options": {"include_usage": True}, "user": "u1"})
    ids, params = TRANSLATOR.generate_request(parsed.request)
    assert ids == list(b"system: A\n\nB\nuser: hi\nassistant: ")
    assert (params.max_tokens, params.temperature, params.top_k, params.seed, params.stop_strings) == \
        (5, 0.0, 3, 7, ("\n",))
    assert params.logprobs == 1          # the chosen token's logprob needs one from the engine
    assert parsed.options == openai_api.Options(chat=True, stream=True, include_usage=True, logprobs=True)


def test_completion_prompts_and_a_missing_max_tokens():
    for prompt in ("hi", ["hi"], [0, 104, 105], [[0, 104, 105]]):
        ids, params = TRANSLATOR.generate_request(openai_api.parse_completion({"prompt": prompt}).request)
        assert ids == [0, 104, 105]
        assert params.max_tokens == min(50, 100 - 3)   # as many as fit, up to the cap
    parsed = openai_api.parse_completion({"prompt": "x", "logprobs": 0})
    assert parsed.request.logprobs == 1 and parsed.options.logprobs and parsed.options.top_logprobs == 0


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "n": 3}, "n must be 1"),
    ({"prompt": "x", "best_of": 2}, "best_of is not supported"),
    ({"prompt": "x", "echo": True}, "echo is not supported"),
    ({"prompt": "x", "logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens must be an integer"),
    ({"prompt": "x", "top_p": float("nan")}, "top_p must be a number"),
    ({"prompt": "x", "seed": -1}, "seed must be an integer in [0, 2^63)"),
    ({"prompt": "x", "stop": [1]}, "stop must be a string or a list of strings"),
    ({"prompt": []}, "prompt must be a string or a list of token ids"),
    ({"prompt": [1, 999]}, "token ids must be in [0, 259)"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "structured output is not supported"),
])
def test_bad_completion_bodies_name_the_field(body, needle):
    with pytest.raises(InvalidRequestError) as e:
        TRANSLATOR.generate_request(openai_api.parse_completion(body).request)
    assert needle in str(e.value)


@pytest.mark.parametrize("raw, where, char", [
    (rb'{"messages": [{"role": "user", "content": "hi \ud83d"}]}', "messages[0].content", r"\ud83d"),
    (rb'{"prompt": "x", "stop": ["ok", "\udc00 trailing"]}', "stop[1]", r"\udc00"),
    (rb'{"metadata": {"\ud800": 1}}', "a key of metadata", r"\ud800"),
    (rb'{"prompt": "\ude00\ud83d"}', "prompt", r"\ude00"),            # a pair in the wrong order is two halves
])
def test_a_lone_surrogate_is_refused_with_where_it_is(raw, where, char):
    with pytest.raises(InvalidRequestError) as e:
        openai_api.parse_body(raw)
    assert str(e.value).startswith(f"{where} holds a lone UTF-16 surrogate ({char})")


def test_a_surrogate_pair_is_one_character():
    assert openai_api.parse_body(rb'{"prompt": "\ud83d\ude00!"}') == {"prompt": "\U0001F600!"}


def test_chat_errors_count_messages_as_the_client_sent_them():
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                         {"role": "tool", "content": "t"}], "max_tokens": 4}
    with pytest.raises(InvalidRequestError, match=r"messages\[2\]\.role is 'tool'"):
        TRANSLATOR.generate_request(openai_api.parse_chat(body).request)
    with pytest.raises(InvalidRequestError, match="lower max_tokens to at most"):
        TRANSLATOR.generate_request(openai_api.parse_chat(
            {"messages": [{"role": "user", "content": "x" * 60}], "max_tokens": 50}).request)


def test_writer_shapes_usage_finish_reason_and_logprobs():
    options = openai_api.Options(chat=False, logprobs=True, top_logprobs=1, return_token_ids=True)
    writer = openai_api.Writer(options, Started("r1", 3, "tiny", SamplingParams()), lambda t: chr(t))
    outs = [StepOutput("r1", [65, 66], "AB", logprobs=[[TokenLogprob(65, -0.5), TokenLogprob(65, -0.5)],
                                                       [TokenLogprob(66, -1.0), TokenLogprob(67, -0.2)]]),
            StepOutput("r1", [67], "C", logprobs=[[TokenLogprob(67, -0.1), TokenLogprob(67, -0.1)]])]
    finish = Finished(FinishReason.STOP_STRING, prompt_tokens=3, cached_prompt_tokens=2, output_tokens=3,
                      queue_ms=1, ttft_ms=2, total_ms=3)
    reply = writer.reply(outs, finish)
    choice = reply["choices"][0]
    assert reply["id"] == "cmpl-r1" and reply["object"] == "text_completion"
    assert choice["text"] == "ABC" and choice["finish_reason"] == "stop" and choice["token_ids"] == [65, 66, 67]
    assert choice["logprobs"] == {"tokens": ["A", "B", "C"], "token_logprobs": [-0.5, -1.0, -0.1],
                                  "top_logprobs": [{"A": -0.5}, {"C": -0.2}, {"C": -0.1}], "text_offset": [0, 1, 2]}
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                              "prompt_tokens_details": {"cached_tokens": 2}}
    chat = openai_api.Writer(openai_api.Options(chat=True, stream=True, include_usage=True),
                             Started("r2", 3, "tiny", SamplingParams()), chr)
    assert chat.first_chunk()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk(outs[0])["choices"][0]["delta"] == {"content": "AB"} and chat.chunk(outs[0])["usage"] is None
    last, usage = chat.last_chunks(dataclasses.replace(finish, finish_reason=FinishReason.LENGTH))
    assert last["choices"][0]["finish_reason"] == "length" and last["object"] == "chat.completion.chunk"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 6
