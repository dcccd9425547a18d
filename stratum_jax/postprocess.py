"""Post-processing a step read back: each live row's sampled tokens into its sequence (streamed outputs,
stop decisions, finished requests), prompt logprobs and attention-score variance, and full pages offered to
the prefix cache. Rows that went stale while the step was in flight (inflight.row_is_live) are skipped."""
from __future__ import annotations

from stratum_jax.inflight import row_is_live, token_read
from stratum_jax.model_runner import InFlightStep, RunResult
from stratum_jax.outputs import OutputProcessor, token_logprobs
from stratum_jax.request import StepOutput
from stratum_jax.request_table import RequestTable
from stratum_jax.sequence import Sequence


class Postprocessor:
    """processor: the per-token output handling; requests: the table rows are checked against, and that
    finished requests leave; attn_stats: whether steps measure attention-score variance (else its rows are
    zeros, not kept)."""

    def __init__(self, processor: OutputProcessor, requests: RequestTable, attn_stats: bool):
        self.processor = processor
        self.requests = requests
        self.attn_stats = attn_stats

    def __call__(self, step: InFlightStep, run: RunResult, outputs: dict[str, StepOutput]) -> None:
        """Adds each live row's results of `step` (read back as `run`) to `outputs`, by request id."""
        batch, res, epochs = step.batch, run.result, step.epochs
        if run.shape.kind == "decode":
            # DecodeResult [steps, rows]: row r ran decode_steps[r] steps.
            for r, (seq, n) in enumerate(zip(batch.decode, batch.decode_steps)):
                if row_is_live(seq, epochs[r], self.requests):
                    self._decode_row(seq, res, [(i, r) for i in range(n)], outputs)
            return
        # PackedOutput [rows]: decode rows first (one token each), then one row per prefill chunk.
        for r, seq in enumerate(batch.decode):
            if row_is_live(seq, epochs[r], self.requests):
                self._decode_row(seq, res, [r], outputs)
        for i, (seq, n) in enumerate(zip(batch.prefill, batch.chunk_lens)):
            r = len(batch.decode) + i
            if not row_is_live(seq, epochs[r], self.requests):
                continue
            start = step.chunk_starts[i]
            if res.prompt_logprob is not None and step.device.wants_prompt_logprobs[i]:
                off = run.offsets[r]
                self.processor.collect_prompt_logprobs(seq, start, n, res.prompt_logprob[off:off + n],
                                                       res.prompt_top_ids[off:off + n],
                                                       res.prompt_top_logprobs[off:off + n])
            register_full_pages(seq)
            if start + n < seq.num_known_tokens:
                continue                     # a middle prefill chunk: nothing sampled
            token_read(seq)
            self._append_token(seq, res, r, outputs)

    def _decode_row(self, seq: Sequence, res, indices: list, outputs: dict[str, StepOutput]) -> None:
        """A decode row's tokens, at `indices` of res's arrays ((step, row) of a DecodeResult, row of a
        PackedOutput), in order; the ones after a token that finishes the request are discarded."""
        for idx in indices:
            token_read(seq)
            if self.attn_stats:
                seq.recent_attn_var.append(float(res.attn_score_var[idx]))
            if self._append_token(seq, res, idx, outputs):
                return
        register_full_pages(seq)

    def _append_token(self, seq: Sequence, res, idx, outputs: dict[str, StepOutput]) -> bool:
        """Adds the token res sampled at `idx` (with its logprobs, if seq asked) to seq; returns True if
        that finished the request."""
        token = int(res.tokens[idx])
        lps = token_logprobs(seq.params.logprobs, token, res.logprob[idx], res.top_ids[idx], res.top_logprobs[idx])
        reason = self.processor.append_token(seq, token, lps, outputs)
        if reason is not None:
            self.requests.finish(seq, reason, outputs)
        return reason is not None


def register_full_pages(seq: Sequence) -> None:
    """Offers seq's full pages to the prefix cache: pages whose tokens the host knows and whose K/V every
    dispatched step writes (a step still in flight writes them before any later step reads)."""
    computed = min(seq.num_computed, seq.num_known_tokens)
    if seq.blocks is not None and seq.blocks.has_unregistered_full_pages(computed):
        seq.blocks.register_full_pages(seq.all_token_ids, computed, seq.request_id)
