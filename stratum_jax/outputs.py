"""Output handling: a sampled token -> the request's StepOutput (token ids, streamed text held back
around stop strings, logprobs) and the stop decision (stop token, EOS, stop string, length)."""
from __future__ import annotations

import time

import numpy as np

from stratum_jax.request import FinishReason, StepOutput, TokenLogprob
from stratum_jax.sequence import Sequence


def token_logprobs(k: int, token: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray
                   ) -> list[list[TokenLogprob]] | None:
    """[[the chosen token's logprob, then the top-k]] for one token, or None when k == 0."""
    if k == 0:
        return None
    return [[TokenLogprob(token, float(logprob))] + [
        TokenLogprob(int(i), float(v)) for i, v in zip(top_ids[:k], top_logprobs[:k])]]


class OutputProcessor:
    """eos: token ids that end a request (unless it ignores EOS); max_context: the context limit."""

    def __init__(self, eos: frozenset[int], max_context: int):
        self.eos = eos
        self.max_context = max_context

    def output_for(self, seq: Sequence, outputs: dict[str, StepOutput]) -> StepOutput:
        """The StepOutput this step returns for seq (created on first use)."""
        out = outputs.get(seq.request_id)
        if out is None:
            out = StepOutput(request_id=seq.request_id, new_token_ids=[], text_delta="",
                             prompt_tokens=len(seq.prompt_ids), cached_prompt_tokens=seq.cached_prompt_tokens)
            if seq.wants_prompt_logprobs and not seq.is_prefilling:
                # A one-token prompt skips prefill: its only position has no logprob.
                out.prompt_logprobs = seq.prompt_logprobs or [[]]
                seq.prompt_logprobs_sent = True
            outputs[seq.request_id] = out
        out.output_tokens = len(seq.output_ids)
        return out

    def append_token(self, seq: Sequence, token: int, lps, outputs: dict[str, StepOutput]) -> FinishReason | None:
        """Adds a sampled token; returns why the request must finish now, or None."""
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.output_ids.append(token)
        out = self.output_for(seq, outputs)
        out.new_token_ids.append(token)
        if lps is not None:
            out.logprobs = (out.logprobs or []) + lps
        p = seq.params
        reason = None
        if token in p.stop_token_ids:
            reason = FinishReason.STOP_TOKEN
        elif token in self.eos and not p.ignore_eos:
            reason = FinishReason.EOS
        else:
            seq.pending_text += seq.detokenizer.push(token)
            reason = self._check_stop_strings(seq)
        if reason is None and (len(seq.output_ids) >= p.max_tokens or seq.num_known_tokens >= self.max_context):
            reason = FinishReason.LENGTH
        if reason is None:
            # Hold back text that might be the start of a stop string.
            hold = max((len(s) for s in p.stop_strings), default=1) - 1
            cut = len(seq.pending_text) - hold if hold else len(seq.pending_text)
            if cut > 0:
                out.text_delta += seq.pending_text[:cut]
                seq.emitted_text += seq.pending_text[:cut]
                seq.pending_text = seq.pending_text[cut:]
        return reason

    def finish(self, seq: Sequence, reason: FinishReason, outputs: dict[str, StepOutput]) -> StepOutput:
        """Flushes seq's held-back text (none for a stop string or a cancel) into its final output."""
        out = self.output_for(seq, outputs)
        if reason not in (FinishReason.STOP_STRING, FinishReason.CANCELLED):
            seq.pending_text += seq.detokenizer.flush()
        if reason != FinishReason.CANCELLED:
            out.text_delta += seq.pending_text
            seq.emitted_text += seq.pending_text
        seq.pending_text = ""
        seq.finish_reason = reason
        out.finished = True
        out.finish_reason = reason
        out.usage = seq.usage.snapshot()
        return out

    @staticmethod
    def collect_prompt_logprobs(seq: Sequence, start: int, n: int, logprob: np.ndarray, top_ids: np.ndarray,
                                top_logprobs: np.ndarray) -> None:
        """Prompt position p gets the logprob of token p given tokens < p; position 0 gets [].
        logprob [n] / top_* [n, K]: the chunk's positions start .. start + n - 1."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [[]]
        k = seq.params.prompt_logprobs
        for c in range(n):
            nxt = start + c + 1
            if nxt >= len(seq.prompt_ids):
                break
            seq.prompt_logprobs.append(
                [TokenLogprob(seq.prompt_ids[nxt], float(logprob[c]))] + [
                    TokenLogprob(int(i), float(v)) for i, v in zip(top_ids[c, :k], top_logprobs[c, :k])])

    @staticmethod
    def _check_stop_strings(seq: Sequence) -> FinishReason | None:
        if not seq.params.stop_strings:
            return None
        text = seq.emitted_text + seq.pending_text
        longest = max(len(s) for s in seq.params.stop_strings)
        search_from = max(0, len(seq.emitted_text) - longest + 1)
        hits = [i for i in (text.find(s, search_from) for s in seq.params.stop_strings) if i >= 0]
        if not hits:
            return None
        seq.pending_text = text[len(seq.emitted_text):min(hits)]
        return FinishReason.STOP_STRING
