"""The model's shape and numerics: one frozen (hashable) dataclass, built from a preset or an HF config.json.

`ModelConfig` is passed to jitted functions as a static argument, so every field is hashable: the HF
`rope_scaling` dict is stored as a sorted tuple of (key, value) pairs (see `ModelConfig.rope_scaling`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

_DTYPES = ("float32", "bfloat16")

# Keys each supported rope type needs, beyond "rope_type" itself.
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Architectures whose HF module layout is the one `llama.py` implements.
_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 3.x, Qwen2/2.5, Mistral without sliding window).

    rope_scaling: None (plain RoPE) or a sorted tuple of (key, value) pairs, the frozen form of HF's
      `rope_scaling` / `rope_parameters` dict without "rope_theta". Supported:
        (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
         ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
        (("factor", 2.0), ("rope_type", "linear"))
      Build it with `freeze_rope_scaling(dict)`; read it back with `rope_scaling_dict()`.
    attention_bias: q/k/v projections carry a bias (Qwen2); o_proj never does.
    dtype: the dtype of parameters, activations and the KV cache ("float32" or "bfloat16").
    Construction validates (see `validate`), so a ModelConfig that exists is usable.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field when the config cannot describe a working model."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            if not (isinstance(self.rope_scaling, tuple)
                    and all(isinstance(p, tuple) and len(p) == 2 for p in self.rope_scaling)):
                raise ValueError("ModelConfig.rope_scaling must be a tuple of (key, value) pairs (build it with "
                                 f"freeze_rope_scaling), got {self.rope_scaling!r}")
            _check_rope_scaling(self.rope_scaling_dict())
        for name, ids in (("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,)),
                          ("eos_token_ids", self.eos_token_ids)):
            if not isinstance(ids, tuple):
                raise ValueError(f"ModelConfig.{name} must be a tuple, got {ids!r}")
            for i in ids:
                if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                    raise ValueError(
                        f"ModelConfig.{name}: {i!r} is not a token id in [0, vocab_size={self.vocab_size})")

    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """The rope_scaling pairs as a dict (None when RoPE is unscaled)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def num_params(self) -> int:
        """Number of parameters (the tied lm_head counted once)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.attention_bias:
            attn += q + 2 * kv
        layer = attn + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * layer + self.hidden_size + head

    @classmethod
    def from_hf_config(cls, d: dict, dtype: str | None = None) -> ModelConfig:
        """Builds a config from a parsed HF `config.json` (transformers 4.x or 5.x layout).

        Supports LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM (full attention only).
        `dtype` overrides the checkpoint's dtype; without it, float32 checkpoints stay float32 and
        every other dtype (bfloat16, float16) becomes bfloat16. Raises ValueError naming the field
        of anything this decoder cannot run.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or []
        if len(archs) != 1 or archs[0] not in _ARCHITECTURES:
            raise ValueError(f"config.json field 'architectures' is {archs!r}; supported: {list(_ARCHITECTURES)}")
        arch = archs[0]

        def need(key: str) -> Any:
            if key not in d:
                raise ValueError(f"config.json is missing the field {key!r} (needed for {arch})")
            return d[key]

        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json field 'hidden_act' is {d['hidden_act']!r}; only 'silu' is supported")
        if d.get("mlp_bias"):
            raise ValueError("config.json field 'mlp_bias' is true; MLP biases are not supported")
        if arch == "Qwen2ForCausalLM":
            attention_bias = True  # Qwen2 always has q/k/v biases, whatever the config says
            if d.get("use_sliding_window"):
                raise ValueError("config.json field 'use_sliding_window' is true; sliding-window attention "
                                 "is not supported")
        else:
            if d.get("attention_bias"):
                raise ValueError(f"config.json field 'attention_bias' is true; {arch} then has an o_proj "
                                 "bias, which is not supported")
            attention_bias = False
            if arch == "MistralForCausalLM" and d.get("sliding_window") is not None:
                raise ValueError(f"config.json field 'sliding_window' is {d['sliding_window']!r}; "
                                 "sliding-window attention is not supported (it must be null)")
        layer_types = d.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config.json field 'layer_types' has {sorted(set(layer_types))}; only "
                             "'full_attention' layers are supported")

        # transformers 5 moved rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0 or d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json field 'partial_rotary_factor' must be 1.0 (partial RoPE is not supported)")
        rope.pop("partial_rotary_factor", None)
        max_pos = int(d.get("max_position_embeddings", 4096))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type in _ROPE_KEYS:
            if rope_type == "llama3":
                rope.setdefault("original_max_position_embeddings", max_pos)  # as HF does
            rope_scaling = freeze_rope_scaling({"rope_type": rope_type, **rope})
        else:
            raise ValueError(f"config.json field 'rope_scaling' (or 'rope_parameters') has rope_type "
                             f"{rope_type!r}; supported: 'default', {', '.join(map(repr, _ROPE_KEYS))}")

        if dtype is None:
            dtype = "float32" if d.get("dtype", d.get("torch_dtype")) == "float32" else "bfloat16"
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = d.get("head_dim") or hidden // num_heads
        eos_ids = hf_eos_ids(d.get("eos_token_id"))
        bos = d.get("bos_token_id")
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            max_position_embeddings=max_pos,
            dtype=dtype,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )

    def to_hf_llama_config(self) -> dict[str, Any]:
        """The shape and numerics fields of this config as a transformers-5 LlamaForCausalLM `config.json` (the
        inverse of `from_hf_config` for them; callers add token ids, dtype and the like). Raises ValueError for
        q/k/v biases (a Qwen2 shape, which LlamaForCausalLM cannot hold)."""
        if self.attention_bias:
            raise ValueError("this config has q/k/v biases (Qwen2-shaped); a LlamaForCausalLM config cannot hold them")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # transformers 5: rope_theta and the RoPE scaling go together in `rope_parameters`.
            "rope_parameters": {"rope_type": "default", **(self.rope_scaling_dict() or {}),
                                "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }


def hf_eos_ids(value) -> tuple[int, ...]:
    """An HF `eos_token_id` field (None, an int, or a list of ints) -> a tuple of ids."""
    if value is None:
        return ()
    return tuple(int(e) for e in (value if isinstance(value, list) else [value]) if e is not None)


def freeze_rope_scaling(d: dict[str, Any]) -> tuple:
    """HF rope_scaling dict -> the hashable form ModelConfig stores (validated)."""
    d = dict(d)
    if "type" in d:  # the pre-4.45 spelling
        d.setdefault("rope_type", d.pop("type"))
    _check_rope_scaling(d)
    return tuple(sorted((k, v) for k, v in d.items() if k in ("rope_type", *_ROPE_KEYS[d["rope_type"]])))


def _check_rope_scaling(d: dict[str, Any]) -> None:
    rope_type = d.get("rope_type")
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"ModelConfig.rope_scaling: rope_type {rope_type!r} is not supported; "
                         f"supported: {', '.join(map(repr, _ROPE_KEYS))}")
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in d]
    if missing:
        raise ValueError(f"ModelConfig.rope_scaling ({rope_type}) is missing {missing}")
    for k in _ROPE_KEYS[rope_type]:
        if not (isinstance(d[k], (int, float)) and math.isfinite(d[k]) and d[k] > 0):
            raise ValueError(f"ModelConfig.rope_scaling[{k!r}] must be a positive number, got {d[k]!r}")
    if rope_type == "llama3" and not d["high_freq_factor"] > d["low_freq_factor"]:
        raise ValueError("ModelConfig.rope_scaling: llama3 needs high_freq_factor > low_freq_factor, got "
                         f"{d['high_freq_factor']} <= {d['low_freq_factor']}")


_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

# Random-init shapes for tests and benchmarks. They pair with the ByteTokenizer (loader.load_model), so
# BOS/EOS are its ids 256/257 whatever the vocabulary size.
PRESETS: dict[str, ModelConfig] = {
    # Small enough that a CPU test compiles and runs it in seconds.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, max_position_embeddings=2048, dtype="float32",
        bos_token_id=256, eos_token_ids=(257,)),
    # The shape of Llama-3.2-1B.
    "llama-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rope_scaling=freeze_rope_scaling(dict(_LLAMA3_ROPE, factor=32.0)), tie_word_embeddings=True,
        max_position_embeddings=131072, dtype="bfloat16", bos_token_id=256, eos_token_ids=(257,)),
    # The shape of Llama-3.1-8B.
    "llama-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=freeze_rope_scaling(dict(_LLAMA3_ROPE, factor=8.0)), tie_word_embeddings=False,
        max_position_embeddings=131072, dtype="bfloat16", bos_token_id=256, eos_token_ids=(257,)),
    # The shape of Llama-3.1-70B (141 GB in bf16: more than one H200 holds; --tensor-parallel 2).
    "llama-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=freeze_rope_scaling(dict(_LLAMA3_ROPE, factor=8.0)), tie_word_embeddings=False,
        max_position_embeddings=131072, dtype="bfloat16", bos_token_id=256, eos_token_ids=(257,)),
}
