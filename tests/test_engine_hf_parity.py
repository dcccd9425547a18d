"""The engine's whole path (paged cache, chunked prefill, continuous batching, on-device sampling) against
HF transformers' references for tiny Llama and Qwen2 checkpoints (see tests/hf_reference/)."""
import json
from pathlib import Path

import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.request import SamplingParams

GOLDEN = Path(__file__).parent / "hf_reference" / "golden"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("page_size", [8, 32])
def test_engine_matches_hf_in_one_continuous_batch(name, page_size):
    refs = json.loads((GOLDEN / "reference.json").read_text())["models"][name]
    engine = Engine(RuntimeConfig(model=str(GOLDEN / name), max_context=128, kv_pool_tokens=2048,
                                  prefill_chunk=16, page_size=page_size, max_batch_size=8))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    results = engine.generate([r["ids"] for r in refs], params)
    for ref, res in zip(refs, results):
        assert res.token_ids == ref["greedy"], f"{name}: prompt length {len(ref['ids'])}"
        got = [pos[0].logprob for pos in res.prompt_logprobs[1:]]
        assert got == pytest.approx(ref["prompt_logprobs"], abs=1e-4)
