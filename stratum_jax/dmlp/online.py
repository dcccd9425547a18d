"""Online fine-tuning of the DMLP from live traffic, kept off the decode loop.

The server side is one background thread; the optax steps run in a worker process that it starts
(learner.py). Why a process: XLA's CPU thread pool and the GIL are shared by every thread of a
process, so a learner thread competes with the engine thread however it is throttled. A process
pinned to its own cores (`OnlineConfig.cpu_cores`), with XLA held to one thread and a duty-cycle
budget (`cpu_budget`), does not.

- `observe` never blocks: it puts into a bounded queue and drops the batch when the queue is full.
- The worker validates each round on a recent holdout window and the live weights change only when
  the candidate is no worse on the decided labels; the thread then hot-swaps `model.params` (one
  reference assignment). A round whose holdout has one class at the decision horizon is not judged
  (logged, counted in `refusals`).
- The worker checkpoints with orbax (atomic) every `checkpoint_interval_s` and at `stop()`, into
  `checkpoint_dir/step-NNNNNNNN`, keeping the newest `keep_checkpoints`.
- Metrics, in the prometheus_client registry given: `stratum_dmlp_accuracy` (live weights on the
  holdout, decision horizon, threshold 0.5), `stratum_dmlp_confidence` (the hot/cold threshold, which
  the worker calibrates on the holdout within its bounds), `stratum_dmlp_updates_total` (hot swaps) and
  `stratum_dmlp_online_dropped_total` (examples dropped by a full queue).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading

import jax
import numpy as np

from stratum_jax.dmlp.model import Predictor
from stratum_jax.dmlp.policy import ConfidenceThreshold
from stratum_jax.dmlp.learner import Learner, OnlineConfig, RoundSchedule, numpy_tree, run_round, worker_main

__all__ = ["InlineFineTuner", "OnlineConfig", "OnlineFineTuner"]
log = logging.getLogger(__name__)


class LiveWeights:
    """What a fine-tuner does with a round's report (`learner.run_round`), in the server and in a
    replay alike: a swap replaces `model.params` (one reference assignment: readers see the old or the
    new tree) and sets the calibrated threshold; both kinds count an evaluation."""

    model: Predictor
    threshold: ConfidenceThreshold
    updates: int
    evaluations: int
    refusals: int        # rounds not judged: one class at the decision horizon in the holdout
    accuracy: float
    _updates_counter: object

    def apply(self, msg: tuple) -> None:
        if msg[0] == "swap":
            _, params, self.accuracy, confidence, updates = msg
            self.model.params = jax.device_put(params)
            if self._updates_counter is not None:
                self._updates_counter.inc(updates - self.updates)
            self.updates = updates
        else:
            _, self.accuracy, confidence, refused = msg
            if refused is not None:
                self.refusals += 1
                log.info("online DMLP round not judged, live weights kept: %s", refused)
        self.threshold.set(confidence)
        self.evaluations += 1


def _example_rows(features, reuse_labels, known, n_features: int, n_horizons: int):
    """(raw [N, F], labels [N, H], known [N, H]) as float32, checked against the model's sizes."""
    raw = np.atleast_2d(np.asarray(features, np.float32))
    labels = np.atleast_2d(np.asarray(reuse_labels, np.float32))
    known = np.ones_like(labels) if known is None else np.atleast_2d(np.asarray(known, np.float32))
    if raw.shape[1:] != (n_features,) or labels.shape != (len(raw), n_horizons) or known.shape != labels.shape:
        raise ValueError(f"observe wants features [N, {n_features}], labels and known [N, {n_horizons}], "
                         f"got {raw.shape}, {labels.shape} and {known.shape}")
    return raw, labels, known


class InlineFineTuner(LiveWeights):
    """The online fine-tuner of a replay: the server's learner, round cadence and swap rule, run in this
    process on the replay's clock instead of a worker process on wall time. `observe` as the server's
    (`OnlineFineTuner.observe`, minus the queue: nothing is dropped); `advance(now_s)` runs the rounds
    due by then. A replay has no wall time to measure a round by, so each round is charged `round_s`
    seconds of its clock; with `config.cpu_budget` that sets the cadence (one round per
    round_s / cpu_budget)."""

    def __init__(self, model: Predictor, config: OnlineConfig, round_s: float,
                 threshold: ConfidenceThreshold | None = None):
        if not round_s > 0:
            raise ValueError(f"round_s must be > 0, got {round_s}")
        self.model, self.config, self.round_s = model, config, round_s
        self.threshold = threshold or ConfidenceThreshold()
        self.learner = Learner(model.config, model.params, model.normalizer, config, self.threshold)
        self.schedule = RoundSchedule(config.cpu_budget)
        self.updates = self.evaluations = self.refusals = 0
        self.accuracy = float("nan")
        self._updates_counter = None
        self.swap_times_s: list[float] = []     # when each swap took effect, on the replay's clock

    def observe(self, features: np.ndarray, reuse_labels: np.ndarray, known: np.ndarray | None = None) -> bool:
        self.learner.add(*_example_rows(features, reuse_labels, known, len(self.model.normalizer.mean),
                                        len(self.model.config.horizons_ms)))
        return True

    def due(self, now_s: float) -> bool:
        """Whether `advance(now_s)` would run a round."""
        return self.learner.ready and self.schedule.wait_s(now_s) == 0.0

    def advance(self, now_s: float) -> bool:
        """Runs a round if one is due at now_s: it starts now and takes round_s, and its result is live
        from now (a replay calls this at each arrival, so the round's own duration is not waited out).
        Returns whether a round ran."""
        if not self.due(now_s):
            return False
        before = self.updates
        self.apply(run_round(self.learner))
        if self.updates != before:
            self.swap_times_s.append(now_s)
        self.schedule.done(now_s + self.round_s, self.round_s)
        return True


class OnlineFineTuner(LiveWeights):
    """model: the live `Predictor` (shared with `DmlpPolicy`); its `params` are replaced on a swap.
    threshold: the policy's `ConfidenceThreshold` (a private one if None). Use: `observe(...)` from the
    engine, `start()` once, `stop()` at shutdown."""

    def __init__(self, model: Predictor, config: OnlineConfig, checkpoint_dir: str, metrics_registry=None,
                 threshold: ConfidenceThreshold | None = None):
        self.model, self.config, self.checkpoint_dir = model, config, checkpoint_dir
        self.threshold = threshold or ConfidenceThreshold()
        self._n_features = len(model.normalizer.mean)
        self._n_horizons = len(model.config.horizons_ms)
        ctx = mp.get_context("spawn")     # never fork a process that has XLA threads
        self._ctx = ctx
        self._data = ctx.Queue(maxsize=config.queue_batches)
        # Never let process exit wait to flush training data nobody will read (a stopped worker).
        self._data.cancel_join_thread()
        self._control = ctx.Queue()
        self._out = ctx.Queue()
        self._process = None
        self._thread: threading.Thread | None = None
        self.updates = 0
        self.evaluations = 0     # rounds the worker evaluated on the holdout (each reports "swap" or "stats")
        self.refusals = 0
        self.dropped = 0
        self.accuracy = float("nan")
        self.error: str | None = None
        self.last_checkpoint: str | None = None
        self._updates_counter = self._dropped_counter = None
        self._registry = None
        if metrics_registry is not None:
            self.export(metrics_registry)

    def observe(self, features: np.ndarray, reuse_labels: np.ndarray, known: np.ndarray | None = None) -> bool:
        """features: raw [F] or [N, F] (NaN = missing); reuse_labels: [H] or [N, H] in {0, 1}; known: like
        reuse_labels, 1 where that horizon's label is decided (None: all are; `OutcomeTracker` gives it).
        Never blocks; returns False (and counts the drop) when the queue is full."""
        raw, labels, known = _example_rows(features, reuse_labels, known, self._n_features, self._n_horizons)
        try:
            self._data.put_nowait((raw, labels, known))
            return True
        except queue.Full:
            self.dropped += len(raw)
            if self._dropped_counter is not None:
                self._dropped_counter.inc(len(raw))
            return False

    def current_params(self):
        return self.model.params

    def start(self) -> None:
        if self._process is not None:
            return
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        t = self.threshold
        self._process = self._ctx.Process(
            target=worker_main, name="dmlp-online-worker", daemon=True,
            args=(self._data, self._control, self._out, self.model.config, numpy_tree(self.model.params),
                  self.model.normalizer, self.config, (t.value, t.low, t.high, t.step),
                  os.path.abspath(self.checkpoint_dir), os.getpid()))
        self._process.start()
        self._thread = threading.Thread(target=self._listen, name="dmlp-online", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stops taking optax steps (examples are still collected) until `resume()`."""
        self._control.put("pause")

    def resume(self) -> None:
        self._control.put("resume")

    def stop(self, timeout_s: float = 120.0) -> str | None:
        """Stops the worker after its final checkpoint; returns that checkpoint's path."""
        if self._process is None:
            return None
        self._control.put("stop")
        self._thread.join(timeout_s)
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.error("online DMLP worker did not stop within %.0f s; terminating it", timeout_s)
            self._process.terminate()
        self._process = self._thread = None
        return self.last_checkpoint

    def _listen(self) -> None:
        """The background thread: applies what the worker reports until it stops."""
        while True:
            try:
                msg = self._out.get(timeout=1.0)
            except queue.Empty:
                if self._process is None or not self._process.is_alive():
                    return
                continue
            kind = msg[0]
            if kind in ("swap", "stats"):
                self.apply(msg)
            elif kind == "checkpoint":
                self.last_checkpoint = msg[1]
            elif kind == "stopped":
                self.last_checkpoint = msg[1]
                return
            elif kind == "error":
                self.error = msg[1]
                log.error("online DMLP fine-tuning failed; the live weights stay as they are:\n%s", msg[1])
                return

    def export(self, registry) -> None:
        """Registers the stratum_dmlp_* metrics in a prometheus_client registry (once; e.g. the server's,
        after the engine built the tuner). Counts made before carry over."""
        import prometheus_client as prom
        if self._registry is not None:
            if self._registry is not registry:
                raise ValueError("the fine-tuner's metrics are already exported to another registry")
            return
        self._registry = registry
        prom.Gauge("stratum_dmlp_accuracy", "DMLP accuracy of the live weights on the online holdout window "
                   "(decision horizon, threshold 0.5).", registry=registry).set_function(lambda: self.accuracy)
        # prometheus_client appends _total to counter names.
        self._updates_counter = prom.Counter("stratum_dmlp_updates", "Online fine-tuning weight hot-swaps.",
                                             registry=registry)
        self._dropped_counter = prom.Counter("stratum_dmlp_online_dropped",
                                             "Online examples dropped because the queue was full.",
                                             registry=registry)
        self._updates_counter.inc(self.updates)
        self._dropped_counter.inc(self.dropped)
        self.threshold.export(registry)
