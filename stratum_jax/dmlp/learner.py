"""The online learner: what the fine-tuning worker process does with live (features, reuse) pairs.

It keeps a recent window of examples; one access in `holdout_every` goes to a holdout window instead
(chosen by a hash of its features, so the rows of one access, one per decided horizon (outcomes.py), land on
the same side). A round takes `steps_per_round` optax steps on a candidate copy of the weights, then compares
candidate and live weights on the holdout: the candidate becomes live only if its holdout loss is no
worse; otherwise it restarts from the live weights. Plain in-process code: `worker_main` runs it in a
separate process (see online.py), tests call it directly.

Labels come with a per-horizon `known` mask: an undecided (censored) horizon counts in neither the loss
nor the holdout comparison, accuracy or threshold calibration. And a round that finds only one class
among the holdout's decided labels at the decision horizon swaps nothing and leaves the threshold as it
is (accuracy is still reported, over the decided labels): such a holdout cannot tell a
model that drifts towards "always reused" from a better one (issue #15's shifted run, whose span is
shorter than the longest horizon, swapped 44 of 45 rounds on it). `refusals` counts those rounds.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import time
import traceback

import numpy as np


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
    queue_batches: int = 1024          # observe() batches waiting for the worker; more are dropped
    window: int = 65536                # recent training examples kept
    holdout_window: int = 8192         # recent holdout examples kept
    holdout_every: int = 5             # one access in 5 is held out
    min_examples: int = 2048           # training examples before the first round
    min_holdout: int = 512
    batch_size: int = 256
    steps_per_round: int = 20
    learning_rate: float = 1e-4
    cpu_budget: float = 0.25           # the worker is busy at most this share of one core's wall time
    cpu_cores: tuple[int, ...] | None = None   # pin the worker to these cores (keep it off the engine's)
    checkpoint_interval_s: float = 300.0
    keep_checkpoints: int = 2
    # The horizon the holdout is judged at (swap or refuse, accuracy) and the hot/cold threshold refers
    # to, in ms: the model's longest horizon not longer than this (`decision_index`). And whether a
    # reuse's labels are held to each horizon's deadline t + h (`OutcomeTracker(hold_reuse=...)`).
    # Chosen together by measurement on issue #15's reduced shifted replay (one seed; BENCHMARKS.md, #15,
    # session 8): at the longest horizon (500 ms) a run shorter than it has only reuses decided there, so
    # every round is refused and the weights never change (+1.58 points over LRU at capacity 0.1,
    # guarded: the offline model's figure); at 200 ms the rounds are judged and the model adapts (+1.46
    # with labels handed over at the reuse); holding a reuse's labels to their deadline makes every label
    # of a horizon arrive at t + h, so its positives no longer run ahead of its negatives (unbiased):
    # +1.98, the best of the three (unguarded too: +1.92 against +1.15 and the offline +1.06).
    # The server (`runtime.build_dmlp`) and the replay (`training/online_replay.py`) both take these
    # from here, through `wiring.wire_policy`; no flag: a user changes the checkpoint, not these.
    decision_horizon_ms: float = 200.0
    hold_reuse: bool = True
    seed: int = 0

    def __post_init__(self):
        if not self.decision_horizon_ms > 0:
            raise ValueError(f"OnlineConfig.decision_horizon_ms must be > 0 (ms), got {self.decision_horizon_ms!r}")


def decision_index(horizons_ms, decision_horizon_ms: float) -> int:
    """Index of the decision horizon among a model's horizons_ms (increasing): the longest not longer than
    decision_horizon_ms, or the shortest when all are longer (a checkpoint with other horizons still has
    one to decide at)."""
    below = [i for i, h in enumerate(horizons_ms) if h <= decision_horizon_ms]
    return below[-1] if below else 0


class _Ring:
    """Fixed-size ring of (raw [F], labels [H], known [H]) rows."""

    def __init__(self, size: int, n_features: int, n_horizons: int):
        self.raw = np.zeros((size, n_features), np.float32)
        self.labels = np.zeros((size, n_horizons), np.float32)
        self.known = np.zeros((size, n_horizons), np.float32)
        self.count = 0

    def add(self, raw: np.ndarray, labels: np.ndarray, known: np.ndarray) -> None:
        idx = (self.count + np.arange(len(raw))) % len(self.raw)
        self.raw[idx], self.labels[idx], self.known[idx] = raw, labels, known
        self.count += len(raw)

    def __len__(self) -> int:
        return min(self.count, len(self.raw))


class Learner:
    """model_config, params, normalizer: the starting DMLP. threshold: a ConfidenceThreshold to
    calibrate on the holdout."""

    def __init__(self, model_config, params, normalizer, config: OnlineConfig, threshold):
        import optax

        from stratum_jax.dmlp.model import DmlpNet
        from stratum_jax.dmlp.train_step import make_step
        self.model_config, self.normalizer, self.config, self.threshold = model_config, normalizer, config, threshold
        self.live = params
        self.candidate = params
        h, f = len(model_config.horizons_ms), len(normalizer.mean)
        self.train = _Ring(config.window, f, h)
        self.holdout = _Ring(config.holdout_window, f, h)
        self.refusals = 0          # rounds whose holdout had one class at the decision horizon
        self.refused: str | None = None
        self.decision = decision_index(model_config.horizons_ms, config.decision_horizon_ms)
        self._net = DmlpNet(model_config)
        self._opt = optax.adamw(config.learning_rate, weight_decay=1e-4)
        self._step = make_step(self._net, self._opt)
        self._opt_state = self._opt.init(params)
        self._rng = np.random.default_rng(config.seed)
        self.updates = 0
        self.accuracy = float("nan")

    def add(self, raw: np.ndarray, labels: np.ndarray, known: np.ndarray | None = None) -> None:
        """raw [N, F], labels [N, H], known [N, H] (1 = that horizon's label is decided; None: all are).
        Rows with no decided horizon are dropped."""
        known = np.ones_like(labels) if known is None else np.asarray(known, np.float32)
        if known.shape != labels.shape:
            raise ValueError(f"known must have the labels' shape {labels.shape}, got {known.shape}")
        keep = known.any(1)
        raw, labels, known = raw[keep], labels[keep], known[keep]
        held = holdout_rows(raw, self.config.holdout_every)
        self.holdout.add(raw[held], labels[held], known[held])
        self.train.add(raw[~held], labels[~held], known[~held])

    @property
    def ready(self) -> bool:
        return len(self.train) >= self.config.min_examples and len(self.holdout) >= self.config.min_holdout

    def round(self) -> bool:
        """One round of steps on the candidate, then the holdout comparison on the decided labels. True if
        it was swapped in; `refused` says why a round was not judged (None when it was)."""
        from stratum_jax.dmlp.features import feature_matrix
        from stratum_jax.dmlp.train_step import mean_bce, predict_in_batches
        cfg, n = self.config, len(self.train)
        for _ in range(cfg.steps_per_round):
            idx = self._rng.integers(0, n, cfg.batch_size)
            x = feature_matrix(self.train.raw[idx], self.normalizer)
            self.candidate, self._opt_state, _ = self._step(self.candidate, self._opt_state, x,
                                                            self.train.labels[idx], self.train.known[idx])
        m = len(self.holdout)
        x_h, y_h, known_h = (feature_matrix(self.holdout.raw[:m], self.normalizer), self.holdout.labels[:m],
                             self.holdout.known[:m])
        p_live = predict_in_batches(self._net, self.live, x_h, batch=1024)
        p_cand = predict_in_batches(self._net, self.candidate, x_h, batch=1024)
        k = self.decision
        decided = known_h[:, k] > 0
        classes = np.unique(y_h[decided, k] > 0.5)
        self.refused = None
        if len(classes) < 2:
            self.refusals += 1
            self.refused = (f"the holdout's {int(decided.sum())} decided labels at the decision horizon are "
                            f"{'all ' + ('reused' if classes[0] else 'not reused') if len(classes) else 'none'}")
            swapped = False
        else:
            swapped = bool(mean_bce(p_cand, y_h, known_h) <= mean_bce(p_live, y_h, known_h))
        if swapped:
            self.live = self.candidate
            self.updates += 1
            best = p_cand
        else:
            self.candidate, self._opt_state = self.live, self._opt.init(self.live)
            best = p_live
        if decided.any():
            self.accuracy = float(((best[decided, k] >= 0.5) == (y_h[decided, k] > 0.5)).mean())
        else:
            self.accuracy = float("nan")
        if self.refused is None:      # one class cannot place a hot/cold threshold either
            self.threshold.calibrate(best[decided, k], y_h[decided, k])
        return swapped

    def checkpoint(self, directory: str) -> str:
        """Writes directory/step-N (one past the newest there) and keeps the newest few."""
        import jax

        from stratum_jax.dmlp.checkpoint import DmlpCheckpoint, latest_checkpoint, save_checkpoint
        latest = latest_checkpoint(directory)
        n = int(os.path.basename(latest).split("-")[1]) + 1 if latest else 1
        path = os.path.join(directory, f"step-{n:08d}")
        extra = {"online_updates": self.updates, "holdout_accuracy": self.accuracy,
                 "confidence": self.threshold.value}
        save_checkpoint(path, DmlpCheckpoint(self.model_config, jax.device_get(self.live), self.normalizer, extra))
        steps = sorted(d for d in os.listdir(directory) if d.startswith("step-") and d[5:].isdigit())
        for old in steps[:-self.config.keep_checkpoints]:
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
        return path


class RoundSchedule:
    """The fine-tuner's cadence, on whatever clock the caller keeps (seconds): the worker's monotonic
    clock in the server, a replay's simulated clock in the cache simulator. After a round that kept the
    learner busy for b seconds, the next is due b * (1 / cpu_budget - 1) later, so busy / (busy + pause)
    = cpu_budget; the learner must also be `ready`."""

    def __init__(self, cpu_budget: float):
        if not 0.0 < cpu_budget <= 1.0:
            raise ValueError(f"cpu_budget must lie in (0, 1], got {cpu_budget}")
        self.cpu_budget = cpu_budget
        self.next_s = -float("inf")

    def wait_s(self, now_s: float) -> float:
        """Seconds until the next round is due (0 if it is)."""
        return max(0.0, self.next_s - now_s)

    def done(self, end_s: float, busy_s: float) -> None:
        """A round ended at end_s after busy_s seconds of work."""
        self.next_s = end_s + busy_s * (1.0 / self.cpu_budget - 1.0)


def run_round(learner: Learner) -> tuple:
    """One round and the message that reports it, as the live weights' owner applies it
    (`online.LiveWeights.apply`): ("swap", params, accuracy, confidence, updates) or
    ("stats", accuracy, confidence, refused: why the round was not judged, or None)."""
    if learner.round():
        return ("swap", numpy_tree(learner.live), learner.accuracy, learner.threshold.value, learner.updates)
    return ("stats", learner.accuracy, learner.threshold.value, learner.refused)


def holdout_rows(raw: np.ndarray, every: int) -> np.ndarray:
    """bool [N]: the rows raw [N, F] that go to the holdout, about one in `every`, by a hash of the feature
    bits: the tracker hands an access over as one row per decided horizon (same features), and a split by
    position would put the same access on both sides."""
    bits = np.ascontiguousarray(raw, np.float32).view(np.uint32).astype(np.uint64)
    mult = np.uint64(0x9E3779B97F4A7C15) ^ np.arange(bits.shape[1], dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    h = (bits * mult[None, :]).sum(1, dtype=np.uint64)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0x94D049BB133111EB)
    return (h >> np.uint64(33)) % np.uint64(every) == 0


def worker_main(data_q, control_q, out_q, model_config, params, normalizer, config: OnlineConfig,
                threshold_state: tuple, checkpoint_dir: str, parent_pid: int) -> None:
    """Entry point of the fine-tuning process. Pins itself, limits XLA to one thread, then loops:
    take data, run a round when ready (and not paused), report swaps, sleep to honour the CPU budget,
    checkpoint on the interval and when told to stop. Commands: "pause", "resume", "stop"."""
    if config.cpu_cores:
        os.sched_setaffinity(0, set(config.cpu_cores))
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    from stratum_jax.dmlp.policy import ConfidenceThreshold
    try:
        value, low, high, step = threshold_state
        learner = Learner(model_config, params, normalizer, config, ConfidenceThreshold(value, low, high, step))
        last_ckpt, pause, paused = time.monotonic(), 0.0, False
        schedule = RoundSchedule(config.cpu_budget)
        while os.getppid() == parent_pid:
            try:    # the pause that keeps the budget doubles as the wait for commands
                cmd = control_q.get(timeout=pause)
            except queue.Empty:
                cmd = None
            if cmd == "stop":
                break
            paused = {"pause": True, "resume": False}.get(cmd, paused)
            _drain(data_q, learner)
            if paused or not learner.ready:
                pause = 0.05
                continue
            busy = time.perf_counter()
            out_q.put(run_round(learner))
            busy = time.perf_counter() - busy
            if time.monotonic() - last_ckpt >= config.checkpoint_interval_s:
                out_q.put(("checkpoint", learner.checkpoint(checkpoint_dir)))
                last_ckpt = time.monotonic()
            now = time.monotonic()
            schedule.done(now, busy)
            pause = schedule.wait_s(now)
        _drain(data_q, learner)
        out_q.put(("stopped", learner.checkpoint(checkpoint_dir)))
    except Exception:
        out_q.put(("error", traceback.format_exc()))


def _drain(data_q, learner: Learner) -> None:
    while True:
        try:
            raw, labels, known = data_q.get_nowait()
        except queue.Empty:
            return
        learner.add(raw, labels, known)


def numpy_tree(params):
    """A params tree as numpy arrays (picklable, device-free)."""
    import jax
    return jax.tree_util.tree_map(np.asarray, jax.device_get(params))
