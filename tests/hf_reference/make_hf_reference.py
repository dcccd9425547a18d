"""Builds tiny random HF models and records what HF transformers computes on them.

Runs under the side interpreter that has torch + transformers (Python 3.11; see .ci/hf_env.sh), not the
project venv. tests/test_hf_parity.py runs it live when STRATUM_HF_PYTHON is set, and always compares
against the committed copy in tests/hf_reference/golden/. Regenerate that copy (after changing this
script, or to follow a new transformers release) with:

    source .ci/hf_env.sh && "$STRATUM_HF_PYTHON" tests/hf_reference/make_hf_reference.py tests/hf_reference/golden

Output, under OUT_DIR:
    llama/   LlamaForCausalLM, llama3 RoPE scaling, untied, head_dim != hidden/heads, saved in shards
    qwen2/   Qwen2ForCausalLM, q/k/v biases, tied embeddings, 1 kv head
    qwen2_rope/  Qwen2ForCausalLM shaped like released Qwen2 where RoPE is most sensitive: rope_theta 1e6,
             head_dim 128, q/k/v biases, untied embeddings; one 130-token prompt (angles up to 129 rad)
    reference.json  per model and prompt: the prompt ids, HF's log-probability of each prompt token
                    given its prefix, the full log_softmax after the last prompt token, and 32 greedy
                    tokens from `generate`.
    pydoc-2m.json   the same for the embedded trained checkpoint stratum_jax/model/weights/pydoc-2m (its
                    bf16 weights upcast to float32, text prompts tokenized by transformers), plus the
                    tokenizer's ids for each text and its rendered chat template.
All in float32 on CPU, eager attention.
"""

import json
import math
import sys
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 272  # >= 259, so the byte tokenizer also fits these checkpoints
PROMPT_LENGTHS = (1, 6, 23, 57)
QWEN2_ROPE_QK_BIAS_STD = 12.0   # q/k bias std of qwen2_rope: large enough that the old RoPE drift exceeded 1e-4
LONG_PROMPT_LENGTHS = (130,)   # qwen2_rope: past 128 positions, where float32 RoPE angle errors show
NEW_TOKENS = 32



def build_models():
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, attn_implementation="eager")
    llama = LlamaConfig(
        hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        # original_max_position_embeddings=32 puts the 8 RoPE frequencies of head_dim 16 in all three llama3
        # bands (kept, smoothed, divided by 8), and the prompts run past position 32.
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32),
        **common)
    qwen2 = Qwen2Config(
        hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0), **common)
    # Kept small (2 heads of 128, MLP 128) so the checkpoint stays ~3 MB.
    qwen2_rope = Qwen2Config(
        hidden_size=256, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), **common)
    return {"llama": (LlamaForCausalLM, llama, 1, PROMPT_LENGTHS, 0.5),
            "qwen2": (Qwen2ForCausalLM, qwen2, 2, PROMPT_LENGTHS, 0.5),
            "qwen2_rope": (Qwen2ForCausalLM, qwen2_rope, 3, LONG_PROMPT_LENGTHS, QWEN2_ROPE_QK_BIAS_STD)}


@torch.no_grad()
def randomize(model, seed, qk_bias_std=0.5):
    """HF's init (std 0.02, zero biases, unit norms) makes near-uniform attention and logits that would
    hide RoPE, bias and norm mistakes; use O(1) activations instead: 1/sqrt(fan_in) matrices (x2 on q/k
    for peaked attention), random biases and norm weights, and small embeddings (std 0.15) so that the
    tied Qwen2 head does not just predict the last token again.

    qk_bias_std: released Qwen2 checkpoints have large q/k biases (tens), so their attention scores are
    large and small RoPE angle errors move the log-probs; qwen2_rope copies that with a larger value."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_((qk_bias_std if ("q_proj" in name or "k_proj" in name) else 0.5) * noise)
        elif name.endswith("embed_tokens.weight"):
            p.copy_(0.15 * noise)
        else:
            gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
            p.copy_(gain * noise / math.sqrt(p.shape[1]))


@torch.no_grad()
def reference_for(model, seed, prompt_lengths):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in prompt_lengths:
        ids = torch.randint(0, VOCAB, (1, n), generator=g)
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        prompt_lp = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append({"ids": ids[0].tolist(), "prompt_logprobs": prompt_lp.tolist(),
                    "last_logprobs": logprobs[-1].tolist(), "greedy": gen[0, n:].tolist()})
    return out


def main(out_dir: str) -> None:
    out = Path(out_dir)
    torch.manual_seed(0)
    ref = {"transformers": transformers.__version__, "torch": torch.__version__, "models": {}}
    for name, (cls, cfg, seed, prompt_lengths, qk_bias_std) in build_models().items():
        model = cls(cfg).eval()
        randomize(model, seed, qk_bias_std)
        model.generation_config.eos_token_id = None
        # Shards exercise the loader's model.safetensors.index.json path.
        model.save_pretrained(out / name, max_shard_size="100KB" if name == "llama" else "10MB")
        ref["models"][name] = reference_for(model, seed, prompt_lengths)
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    (out / "pydoc-2m.json").write_text(json.dumps(pydoc_reference(), indent=1) + "\n")


PYDOC_DIR = Path(__file__).resolve().parents[2] / "stratum_jax" / "model" / "weights" / "pydoc-2m"
PYDOC_PROMPTS = (
    "Python is a programming language that",
    "The :func:`len` function returns the number of items",
    "Dictionaries are sometimes found in other languages as \"associative memories\" or \"associative arrays\". "
    "Unlike sequences, which are indexed by a range of numbers, dictionaries are indexed by keys, which can be "
    "any immutable type.",
)
PYDOC_CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a list?"},
              {"role": "assistant", "content": "A mutable sequence."}, {"role": "user", "content": "And a tuple?"}]


@torch.no_grad()
def pydoc_reference():
    """HF's view of the embedded checkpoint: tokenization (with BOS, as the runtime encodes a prompt),
    float32 prompt log-probs and 32 greedy tokens (EOS ignored), and the chat template's rendering."""
    tok = transformers.AutoTokenizer.from_pretrained(PYDOC_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(PYDOC_DIR, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    refs = []
    for text in PYDOC_PROMPTS:
        ids = torch.tensor([tok(text).input_ids])
        n = ids.shape[1]
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
        refs.append({"text": text, "ids": ids[0].tolist(),
                     "prompt_logprobs": logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist(),
                     "last_logprobs": logprobs[-1].tolist(), "greedy": gen[0, n:].tolist()})
    chat = tok.apply_chat_template(PYDOC_CHAT, tokenize=False, add_generation_prompt=True)
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "model_class": type(model).__name__, "prompts": refs, "chat_messages": PYDOC_CHAT, "chat_text": chat}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    main(sys.argv[1])
