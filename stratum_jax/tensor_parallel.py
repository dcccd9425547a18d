"""Tensor parallelism (`--tensor-parallel N`): a `tp` device mesh and the Megatron layout of the model on it.

The layout is expressed only as shardings of the parameters and KV pools; `jit` (GSPMD) partitions the
step from them, and the attention, which indexes pages, runs per shard under `shard_map`
(stratum_jax/tp_attention.py). Per decoder layer (weights in torch's [out, in] layout):

    q_proj, k_proj, v_proj  [heads * head_dim, hidden]   P("tp", None)   column-parallel: each device
    gate_proj, up_proj      [intermediate, hidden]        P("tp", None)   computes its heads / FFN slice
    o_proj                  [hidden, heads * head_dim]    P(None, "tp")   row-parallel: partial sums,
    down_proj               [hidden, intermediate]        P(None, "tp")   one all-reduce after each
    norms                                                 P()             replicated
    k_pool, v_pool          [kv_heads, slots, head_dim]   P("tp", None, None): each device holds its heads
    embed_tokens, lm_head   [vocab, hidden]               P("tp", None) (vocab-parallel) or P()

`--tp-embedding auto` (the default) picks one of the two per model (`choose_embedding`): replicated unless
copying the LM head to every device adds more than AUTO_REPLICATED_MAX_EXTRA_BYTES to what each device
reads per step.

Fewer KV heads than devices (num_kv_heads < N): every KV head is repeated N / num_kv_heads times, so the
model on the mesh has N KV heads, one per device, and device d's q heads read the copy on device d. With
HF's grouping (q head h reads kv head h // (num_heads / num_kv_heads)) the repeated model computes exactly
what the original does; `tp_model_config` and `kv_source_rows` describe the repetition.

The page pool, scheduler and cache policy stay host-side and single: they hand one set of block tables
to the step, and every device applies them to its own heads. With several processes (jax.distributed,
stratum_jax/distributed.py) each process runs the same host-side code on the same inputs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from stratum_jax.config import TP_EMBEDDINGS
from stratum_jax.model.config import ModelConfig
from stratum_jax.model.llama import init_params, param_shapes

AXIS = "tp"
# `--tp-embedding auto`: the most LM-head bytes replication may add to each device's per-step read.
# Measured on two H200s (llama-8b, batch 1, tp=2; BENCHMARKS.md "Tensor parallelism on two H200s"): the
# replicated head read 0.53 GB (~0.13 ms) more per device and its step still took 4.50 ms against 6.41 ms
# vocab-parallel: so vocab-parallel's embedding all-reduce, logits gather and sharded sampling cost ~2 ms
# per step (inferred from the two step times, not profiled apart). 2 GiB is ~0.5 ms at the 4.1 TB/s copy
# bandwidth measured there, a quarter of that. The gathered logits grow with the batch while the extra
# read does not, so batch size does not enter the rule; batch 64 replicated was not measured yet
# (benchmarks/gpu_tp_session.sh runs it) and is what would confirm or break that. Memory: replication
# also copies the embedding, at most 2 x 2 GiB more per device (~3% of an H200).
AUTO_REPLICATED_MAX_EXTRA_BYTES = 2 << 30


def choose_embedding(cfg: ModelConfig, size: int) -> str:
    """`--tp-embedding auto` for `cfg` over `size` devices: "replicated" when the LM head copied to every
    device adds at most AUTO_REPLICATED_MAX_EXTRA_BYTES per device ((size - 1) / size of the [vocab,
    hidden] head; the embedding lookup reads only its rows) or when size does not divide the vocabulary,
    else "vocab-parallel"."""
    if size <= 1 or cfg.vocab_size % size:
        return "replicated"
    head = cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize
    return "replicated" if head * (size - 1) // size <= AUTO_REPLICATED_MAX_EXTRA_BYTES else "vocab-parallel"


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The mesh of one engine (hashable: it is part of the step's static geometry).

    mesh: a 1-D jax Mesh with axis "tp" over N devices (all processes' devices with jax.distributed).
    vocab_parallel: embedding and LM head split over the vocabulary (True) or replicated (False); None
        (`--tp-embedding auto`) until `for_model` chooses for a model, which load_model does.
    """

    mesh: Mesh
    vocab_parallel: bool | None = True

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    def sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding()

    @property
    def kv_sharding(self) -> NamedSharding:
        """Of each k_pool / v_pool [kv_heads, slots, head_dim]: split over kv heads."""
        return self.sharding(AXIS, None, None)

    def for_model(self, cfg: ModelConfig) -> TensorParallel:
        """This mesh with `--tp-embedding auto` decided for cfg (choose_embedding); unchanged otherwise."""
        if self.vocab_parallel is not None:
            return self
        return dataclasses.replace(self, vocab_parallel=choose_embedding(cfg, self.size) == "vocab-parallel")

    def splits_vocab(self) -> bool:
        """Whether the embedding and LM head are split over the vocabulary (ValueError while undecided)."""
        if self.vocab_parallel is None:
            raise ValueError("--tp-embedding auto is decided per model: lay the model out with "
                             "tp.for_model(cfg) (load_model does) before using the mesh")
        return self.vocab_parallel

    def check_model(self, cfg: ModelConfig) -> None:
        """Raises ValueError saying what to change when cfg cannot be split N ways."""
        n = self.size
        flag = f"--tensor-parallel {n}"
        if cfg.num_heads % n:
            raise ValueError(f"{flag} must divide the model's {cfg.num_heads} attention heads: use a divisor "
                             f"of {cfg.num_heads}")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            raise ValueError(f"{flag} and the model's {cfg.num_kv_heads} KV heads must divide one another (the "
                             "KV heads are split over the devices, or repeated when fewer): use a divisor or "
                             f"a multiple of {cfg.num_kv_heads}")
        if cfg.intermediate_size % n:
            raise ValueError(f"{flag} must divide the model's intermediate_size {cfg.intermediate_size}")
        if self.splits_vocab() and cfg.vocab_size % n:
            raise ValueError(f"{flag} must divide the vocabulary ({cfg.vocab_size}) for a vocab-parallel "
                             "embedding: add --tp-embedding replicated")

    def tp_model_config(self, cfg: ModelConfig) -> ModelConfig:
        """cfg as laid out on the mesh: at least N KV heads (module docstring)."""
        self.check_model(cfg)
        return dataclasses.replace(cfg, num_kv_heads=max(cfg.num_kv_heads, self.size))

    def kv_source_rows(self, cfg: ModelConfig) -> np.ndarray | None:
        """For k_proj / v_proj of the mesh's config: row i of the repeated weight [N * head_dim, hidden]
        is row kv_source_rows[i] of the original [num_kv_heads * head_dim, hidden] (int64 [N * head_dim]);
        None when no head is repeated. Expanded head e copies original head e // (N / num_kv_heads)."""
        if cfg.num_kv_heads >= self.size:
            return None
        heads = np.arange(self.size) // (self.size // cfg.num_kv_heads)
        return (heads[:, None] * cfg.head_dim + np.arange(cfg.head_dim)[None, :]).ravel()

    def param_shardings(self, cfg: ModelConfig, params_like) -> dict:
        """A tree of NamedShardings for a parameter tree shaped like `params_like` (param_shapes of cfg)."""
        vocab = (AXIS, None) if self.splits_vocab() else (None, None)

        def spec(path, leaf):
            names = [k.key for k in path]
            module, kind = names[-2], names[-1]
            if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                return self.sharding(AXIS, None) if kind == "weight" else self.sharding(AXIS)
            if module in ("o_proj", "down_proj"):
                return self.sharding(None, AXIS)
            if module in ("embed_tokens", "lm_head"):
                return self.sharding(*vocab)
            return self.sharding(*([None] * len(leaf.shape)))        # norms

        return jax.tree_util.tree_map_with_path(spec, params_like)


def replicate(tree, tp: TensorParallel | None):
    """Constrains a step's results (tokens, logits, ...) to be whole on every device, so every process
    can read them (with jax.distributed a sharded result is not addressable from one process)."""
    return tree if tp is None else jax.lax.with_sharding_constraint(tree, tp.replicated)


def shard_vocab(logits: jax.Array, tp: TensorParallel | None) -> jax.Array:
    """logits [N, vocab]: kept split over the vocabulary as a vocab-parallel LM head computes them.
    Without this, a replicated consumer (`replicate`) makes jit gather the whole LM head weight onto
    every device (a [vocab, hidden] all-gather per step) rather than the far smaller logits."""
    if tp is None or not tp.splits_vocab():
        return logits
    return jax.lax.with_sharding_constraint(logits, tp.sharding(None, AXIS))


def make_tensor_parallel(size: int, *, embedding: str = "vocab-parallel",
                         devices: list | None = None) -> TensorParallel | None:
    """The mesh over the first `size` of `devices` (default jax.devices(): every process's devices), or
    None for size 1 (the single-device path, with no mesh at all). ValueError when there are too few.
    embedding "auto" leaves the choice to `for_model` (load_model calls it)."""
    if embedding not in TP_EMBEDDINGS:
        raise ValueError(f"--tp-embedding must be one of {TP_EMBEDDINGS}, got {embedding!r}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"--tensor-parallel must be a positive integer, got {size!r}")
    if size == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if size > len(devices):
        raise ValueError(
            f"--tensor-parallel {size} needs {size} devices, but jax sees {len(devices)} "
            f"({devices[0].platform}): lower it, or on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={size}, or span hosts with "
            "--coordinator/--num-processes/--process-id")
    if jax.process_count() > 1 and size != len(devices):
        raise ValueError(f"--tensor-parallel {size}: with {jax.process_count()} processes the mesh must span "
                         f"all {len(devices)} devices of all processes: give --tensor-parallel {len(devices)}")
    vocab_parallel = None if embedding == "auto" else embedding == "vocab-parallel"
    return TensorParallel(Mesh(np.array(devices[:size]), (AXIS,)), vocab_parallel=vocab_parallel)


def _is_kv_proj(path) -> bool:
    return path[-2].key in ("k_proj", "v_proj")


def init_params_on_mesh(cfg: ModelConfig, seed: int, tp: TensorParallel) -> tuple[ModelConfig, dict]:
    """Random parameters of `cfg` (llama.init_params: the same values as on one device), created already
    laid out on the mesh. Returns (tp.tp_model_config(cfg), params of that config)."""
    tp_cfg = tp.tp_model_config(cfg)
    rows = tp.kv_source_rows(cfg)
    shapes = param_shapes(cfg)
    shardings = tp.param_shardings(cfg, shapes)
    if rows is not None:
        # The original k/v projections are small (num_kv_heads < N heads): made whole on every device,
        # then each device keeps the rows of its repeated heads.
        shardings = jax.tree_util.tree_map_with_path(
            lambda p, s: tp.replicated if _is_kv_proj(p) else s, shardings)
    params = init_params(cfg, seed, shardings=shardings)
    if rows is None:
        return tp_cfg, params
    target = tp.param_shardings(tp_cfg, param_shapes(tp_cfg))

    takes = {}      # one executable per (weight, bias) sharding, not one per layer

    def repeat(path, x, sharding):
        if not _is_kv_proj(path):
            return x
        take = takes.setdefault(sharding, jax.jit(lambda a: a[rows], out_shardings=sharding))
        return take(x)

    return tp_cfg, jax.tree_util.tree_map_with_path(repeat, params, target)


def place_on_mesh(view: np.ndarray, sharding: NamedSharding, rows: np.ndarray | None = None) -> jax.Array:
    """A host tensor (a checkpoint's memory-mapped view) -> a global array laid out by `sharding`, each
    device receiving only its own block, read from `view` (rows: take view[rows] instead, the KV-head
    repetition of `kv_source_rows`). Only this process's devices are filled."""
    shape = view.shape if rows is None else (len(rows), *view.shape[1:])

    def block(index):
        if rows is not None:
            index = (rows[index[0]], *index[1:])
        # A copy: jax's CPU client would alias a file-backed buffer (see loader._to_device), and on a GPU
        # the block must be contiguous for the transfer anyway.
        return np.array(view[index])

    return jax.make_array_from_callback(shape, sharding, block)
