"""The training loop: accumulation, clipping, schedules, evaluation, logging, progress, metrics.

The Trainer talks to the engine only through its public API (`data_parallel_size/rank` for
batching, `train_step`, `global_mean`, `predict` and `output.loss` for evaluation (evaluate.py),
and the optimizer's `optimizer_shards`), so every layout plugs in unchanged: single, dp, tp, and
pp/fsdp/ep alike.

One optimizer step with gradient accumulation over k micro-steps (DDP's `no_sync` idea):

    for i in range(k):
        loss_i, grads = engine.train_step(x_i, t_i, loss, accumulate=i > 0,
                                          sync=i == k - 1, grad_scale=1 / k)
    # micro-steps 0..k-2 return their local loss and communicate nothing; the last one averages
    # the gradients over the data axes and returns its global mean loss. The step's loss is
    # (global_mean(sum of the first k-1 local losses) + loss_{k-1}) / k.
    clip_grad_norm(engine, grads, clip); optimizer.step(grads)

A masked data set (fine-tune rows, sft_rows.py: labels of -100 count nowhere) is averaged over
the step's counted targets instead: one engine.count_targets over its micro-batches and ranks
gives `count`, each micro-step gets count= (and the rows' documents=) and grad_scale 1, not
1/k, and the step's loss is the sum of the k shares: one device's mean over the global batch.

Checkpoints plug in as a callback: `TrainState` (history.py) holds the step (the data position
follows from it, see DistributedBatcher.position) and the bounded histories, and
`Callback.on_step_end` runs after every optimizer step on every rank (the checkpoint package's
`Checkpointer` saves there; its `resume` restores the engine, the optimizer and `trainer.state`
before `fit()`). Throughput counts what this Trainer ran: a resumed run's samples/s are its
own steps over its own time. `fit` records each phase's peak memory (memory.py) into the metrics.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time

import numpy as np

from ..health.lines import write_line
from ..nn.losses import get_loss
from ..parallel.stages import pipeline_options
from ..validate import check_number
from .data import Dataset, DistributedBatcher
from .evaluate import check_eval_args, evaluate
from .expert_load import expert_load, expert_text
from .history import TrainState
from .memory import PhasePeaks, gather_peaks, peaks_text
from .nonfinite import DEFAULT_MAX_NONFINITE, NonFiniteGuard, quiet
from .optim import clip_grad_norm
from .progress import EVAL_NOTICE_S, progress_bar, slow_notice
from .scaler import GradScaler
from .summary import rate_text, summary_table
from .text import bits_per, sequence_cut

LOG_FORMAT = "%(asctime)s [rank %(rank)d] %(levelname)s %(name)s: %(message)s"


# -- logging -----------------------------------------------------------------------------------
class _TqdmHandler(logging.StreamHandler):
    """Writes around tqdm's bar so log lines do not tear it; each line is one write
    (health/lines.py), so the lines of several ranks never run together."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            with tqdm.external_write_mode(file=self.stream):
                write_line(self.format(record), self.stream)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


class _RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def configure_logging(rank: int, level=logging.INFO, name="mpishard") -> logging.Logger:
    """The 'mpishard' logger: `level` on rank 0, warnings and errors only elsewhere, with the
    rank in every line. Idempotent."""
    logger = logging.getLogger(name)
    for h in [h for h in logger.handlers if getattr(h, "_mpishard", False)]:
        logger.removeHandler(h)
    handler = _TqdmHandler(sys.stderr)
    handler._mpishard = True
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


# -- callbacks -------------------------------------------------------------------------------
class Callback:
    """Hooks run on every rank (collectives are allowed: every rank calls them in step)."""

    def on_train_begin(self, trainer) -> None: ...

    def on_step_end(self, trainer) -> None: ...

    def on_evaluate(self, trainer, result: dict) -> None: ...

    def on_train_end(self, trainer, metrics: dict) -> None: ...


# -- the trainer -------------------------------------------------------------------------------
class Trainer:
    """Train `engine` (already loaded) on `data` with `optimizer`.

    Parameters
    ----------
    batch : global batch size (rows per optimizer step, over all data-parallel ranks)
    steps / epochs : how long (exactly one of them; epochs * steps_per_epoch steps)
    accumulate : micro-steps per optimizer step (batch must divide by accumulate * dp, and
                 each micro-step's local rows by the pipeline's microbatches)
    clip : max global gradient norm, or None
    schedule : step -> lr function (lr.cosine_schedule, ...), or None for a constant lr
    eval_every : evaluate on the test split every this many steps (0: only at the end)
    eval_batch : global rows per evaluation batch (None: the rows of one training micro-step,
                 batch / accumulate); eval_batches: at most this many batches per evaluation
                 (None: the whole test split; 0: no evaluation at all)
    log_every : log the loss on rank 0 every this many steps (0: never)
    progress : a tqdm bar on rank 0 (loss, samples/s)
    callbacks : Callback objects (checkpointing, custom metrics)
    scaler : a scaler.GradScaler (dynamic loss scaling), or None: one is made when the engine
             stores, communicates or computes (compute_dtype) in float16 (engine.precision),
             none otherwise
    on_nonfinite, max_nonfinite : 'stop' (a non-finite loss ends training) or 'skip' (drop the
             update of a step with non-finite loss or gradients; max_nonfinite in a row end
             training); see nonfinite.py
    """

    def __init__(self, engine, optimizer, data: Dataset, loss=None, *, batch=64, steps=None,
                 epochs=None, accumulate=1, clip=None, schedule=None, eval_every=0,
                 eval_batch=None, eval_batches=None, log_every=50, seed=0, progress=True,
                 callbacks=(), logger=None, shuffle=True, scaler=None, on_nonfinite="stop",
                 max_nonfinite=DEFAULT_MAX_NONFINITE):
        if (steps is None) == (epochs is None):
            raise ValueError(f"give exactly one of steps and epochs (got steps={steps}, "
                             f"epochs={epochs})")
        for what, v in (("steps", steps), ("epochs", epochs)):
            if v is not None:
                check_number(what, v, low=1, integer=True)
        for what, v in (("eval_every", eval_every), ("log_every", log_every)):
            check_number(what, v, low=0, integer=True)
        if clip is not None and not (clip > 0 and math.isfinite(clip)):
            # clip_grad_norm refuses a non-finite max_norm; refuse it here, before training
            raise ValueError(f"clip must be a finite number > 0 (or None), got {clip}")
        self.engine, self.optimizer, self.data = engine, optimizer, data
        self.loss = get_loss(loss or data.default_loss)
        self.batcher = DistributedBatcher.for_engine(engine, data.x_train, data.t_train, batch,
                                                     seed, accumulate, shuffle, data.d_train)
        m = _pipeline_microbatches(engine)
        if self.batcher.local_rows % m:      # train_step would raise it mid-fit otherwise
            raise ValueError(f"microbatches={m} does not divide the {self.batcher.local_rows} "
                             f"rows each rank gets per micro-step (batch {batch} / accumulate "
                             f"{accumulate} / {engine.data_parallel_size} data-parallel ranks) "
                             f"of layout {engine.layout.text!r}")
        self.eval_batch = self.batcher.micro_batch if eval_batch is None else eval_batch
        check_eval_args(self.eval_batch, eval_batches, engine.data_parallel_size,
                        engine.layout.text)
        if eval_batches == 0 and eval_every:
            raise ValueError(f"eval_every={eval_every} asks for evaluations that "
                             f"eval_batches=0 turns off")
        self.eval_batches = eval_batches
        self.batch, self.accumulate, self.clip = int(batch), int(accumulate), clip
        self.total_steps = int(steps) if steps is not None else \
            int(epochs) * self.batcher.steps_per_epoch
        self.schedule = schedule
        self.eval_every, self.log_every = int(eval_every), int(log_every)
        self.progress = bool(progress)
        self.callbacks = list(callbacks)
        self.rank = engine.device_id
        self.log = logger or logging.getLogger("mpishard")
        self.state = TrainState()
        self.train_time, self.run_samples = 0.0, 0    # this Trainer's: throughput (resumes)
        self.run_tokens = 0          # counted targets trained on (masked data sets)
        self.memory = PhasePeaks()            # peak memory per phase (memory.py)
        self.eval_notice_s = EVAL_NOTICE_S     # a longer evaluation logs that it still runs
        self.expert_load = {}        # the last step's (expert_load.py); {} for a dense model
        if scaler is None and engine.precision.needs_loss_scaling:
            scaler = GradScaler(engine)
        self.scaler = scaler
        self.nonfinite = NonFiniteGuard(engine, on_nonfinite, max_nonfinite,
                                        check_gradients=scaler is None)

    # -- one optimizer step ----------------------------------------------------------------------
    def train_step(self) -> float:
        """Run the k micro-steps, clip, update; returns the step's global mean loss."""
        with quiet():                 # a diverging step: the guard reports, numpy stays quiet
            loss = self._train_step()
        # a mixture of experts' load, taken before an evaluation's forwards overwrite it
        self.expert_load = expert_load(getattr(self.engine, "stats", {}))
        return loss

    def _train_step(self) -> float:
        e, k, st = self.engine, self.accumulate, self.state
        e.comm.context(step=st.step + 1)       # named by a CollectiveTimeout (health/watchdog.py)
        if self.schedule is not None:
            self.optimizer.lr = self.schedule(st.step)
        batches = [(sequence_cut(e, x), sequence_cut(e, t))      # cp: this rank's chunks
                   for x, t in self.batcher.micro_batches(st.step)]
        count = e.count_targets(np.concatenate([t for _, t in batches]), self.loss) \
            if self.data.masked else None      # the global-token mean (module docstring)
        local_sum, value, grads = 0.0, 0.0, None
        for i, ((x, t), d) in enumerate(zip(batches, self.batcher.micro_documents(st.step))):
            extra = {} if count is None else {"count": count, "documents": d}
            value, grads = e.train_step(x, t, self.loss, accumulate=i > 0, sync=i == k - 1,
                                        grad_scale=self.loss_scale / (k if count is None else 1),
                                        **extra)
            if i < k - 1:
                local_sum += value                       # local losses: no communication yet
        loss = (e.global_mean(local_sum) + value) / (k if count is None else 1) if k > 1 \
            else value
        if not self.nonfinite.allows_update(loss):     # on_nonfinite='skip': drop the update
            if self.clip is not None:
                st.grad_norm_history.append(float("nan"))
        elif self.scaler is not None:          # unscale, clip and step, or skip on inf/nan
            _, norm = self.scaler.step(self.optimizer, self.clip)
            if norm is not None:
                st.grad_norm_history.append(norm)
        else:
            if self.clip is not None:
                st.grad_norm_history.append(clip_grad_norm(e, grads, self.clip))
            self.optimizer.step(grads)
        st.lr_history.append(self.optimizer.lr)
        st.loss_history.append(loss)
        st.step += 1
        st.samples += self.batch
        self.run_samples += self.batch
        self.run_tokens += count or 0
        return loss

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Loss (and accuracy for classification) on the test split, the same on every rank:
        evaluate.py's batches of `eval_batch` rows through `predict`, scored with the
        training loss, at most `eval_batches` of them."""
        d = self.data
        result = {"step": self.state.step, **evaluate(self.engine, d, self.loss,
                                                      self.eval_batch, self.eval_batches)}
        if d.task == "language":              # windows of a text corpus: bits per byte/token
            result.update(bits_per(d.unit, result["test_loss"]))
        return result

    # -- the loop --------------------------------------------------------------------------------
    def fit(self, metrics_path=None) -> dict:
        """Train until `total_steps` (continuing from `state.step`), evaluate, and return the
        metrics dict (the same on every rank); rank 0 writes it to `metrics_path` as JSON."""
        e, st = self.engine, self.state
        for cb in self.callbacks:
            cb.on_train_begin(self)
        self.log.info("training %s on %d rank(s), layout %s: %d steps of %d rows "
                      "(%d micro-step(s) of %d rows per data-parallel rank), %d steps/epoch",
                      e.model.log_name(), e.num_devices, e.layout.text, self.total_steps,
                      self.batch, self.accumulate, self.batcher.local_rows,
                      self.batcher.steps_per_epoch)
        if self.data.masked:            # fine-tune rows: real tokens, counted targets
            self.log.info("%s", self.data.rows_text(self.batch))
        threads = e.blas_threads        # health/threads.py: a pool it changed, it logged itself
        self.log.log(logging.INFO if threads.threads == threads.before else logging.DEBUG,
                     "BLAS threads per rank: %s (%s)", threads.threads or "as started",
                     threads.why)
        bar = self._progress_bar()
        t_start = time.perf_counter()
        self.memory = PhasePeaks()            # the baseline: after start-up and any resume
        self.memory.switch("train")
        while st.step < self.total_steps:
            t0 = time.perf_counter()
            loss = self.train_step()
            self.train_time += time.perf_counter() - t0
            rate = self.samples_per_s
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4g}", samples_s=rate_text(rate), refresh=False)
                bar.update(1)
            if self.log_every and st.step % self.log_every == 0:
                epoch = st.step / self.batcher.steps_per_epoch
                norm = f" grad_norm {st.grad_norm_history[-1]:.4g}" if self.clip else ""
                tokens = (f" tokens/s {rate_text(self.tokens_per_s)}"     # counted targets
                          if self.data.masked or self.data.task == "language" else "")
                self.log.info("step %d/%d epoch %.2f loss %.6g lr %.4g%s samples/s %s%s%s",
                              st.step, self.total_steps, epoch, loss, self.optimizer.lr, norm,
                              rate_text(rate), tokens, expert_text(self.expert_load))
            self.nonfinite.end_of_step(loss, st.step, self.log)
            if self.eval_every and st.step % self.eval_every == 0 and \
                    st.step < self.total_steps and self.eval_batches != 0:
                self._evaluate_and_log()
            for cb in self.callbacks:
                cb.on_step_end(self)
        if bar is not None:
            bar.close()
        final = self._evaluate_and_log() if self.eval_batches != 0 else {}
        self.memory.switch(None)
        metrics = self.metrics(final, time.perf_counter() - t_start)
        metrics.update(gather_peaks(e.comm, self.memory))      # collective
        self.log.info("%s", peaks_text(metrics))
        for cb in self.callbacks:
            cb.on_train_end(self, metrics)
        if metrics_path and self.rank == 0:
            with open(metrics_path, "w") as f:
                json.dump(metrics, f, indent=1)
            self.log.info("wrote metrics to %s", metrics_path)
        return metrics

    def _evaluate_and_log(self) -> dict:
        with quiet(), self.memory.phase("eval"), \
                slow_notice(self.log, f"evaluation at step {self.state.step}", self.eval_notice_s):
            result = self.evaluate()
        self.state.eval_history.append(result)
        acc, unit = result.get("test_accuracy"), getattr(self.data, "unit", None)
        bits = result.get(f"val_bits_per_{unit}")           # a language model: per byte/token
        self.log.info("eval step %d: test loss %.6g%s%s", result["step"], result["test_loss"],
                      "" if acc is None else f", test accuracy {acc:.4f}",
                      "" if bits is None else f" nats/{unit}, {bits:.4f} bits/{unit}")
        for cb in self.callbacks:
            cb.on_evaluate(self, result)
        return result

    def _progress_bar(self):
        if not (self.progress and self.rank == 0):
            return None
        return progress_bar(self.total_steps, self.state.step,
                            f"train {self.engine.layout.text}", self.log_every)

    def metrics(self, final: dict, wall_time: float) -> dict:
        e, st = self.engine, self.state
        metrics = {
            "layout": e.layout.text,
            "world_size": e.num_devices,
            "model": e.model.log_name(),
            "dataset": self.data.name,
            "loss": self.loss.name,
            "optimizer": type(self.optimizer).__name__,
            "dtype": str(np.dtype(e.dtype)),
            "param_dtype": e.precision.param.name,
            "comm_dtype": e.precision.comm.name,
            "compute_dtype": (e.precision.matmul or e.precision.compute).name,
            "tf32": e.precision.tf32,
            "skipped_steps": self.nonfinite.skipped + (0 if self.scaler is None
                                                       else self.scaler.skipped_steps),
            "nonfinite_skipped_steps": self.nonfinite.skipped,
            "loss_scale": self.loss_scale,
            "batch": self.batch,
            "accumulate": self.accumulate,
            "steps": st.step,
            "epochs": st.step / self.batcher.steps_per_epoch,
            "final_loss": st.loss_history[-1] if st.loss_history else None,
            "test_loss": final.get("test_loss"),
            "test_accuracy": final.get("test_accuracy"),
            "samples_per_s": self.samples_per_s,
            "train_time_s": self.train_time,
            "wall_time_s": wall_time,
            "loss_history": list(st.loss_history),
            "grad_norm_history": list(st.grad_norm_history),
            "lr_history": list(st.lr_history),
            "eval_history": list(st.eval_history),
            "history_first_step": st.first_step(),     # history.py: a bounded recent window
        }
        if self.data.task == "language":      # nats and bits per byte/token, tokens/s, corpus
            unit = self.data.unit
            metrics.update(val_loss=final.get("test_loss"), corpus=self.data.corpus,
                           tokens_per_s=self.tokens_per_s,
                           **{f"val_bits_per_{unit}": final.get(f"val_bits_per_{unit}")})
        return metrics

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of a language model's rows: the counted targets for a masked
        data set (padding and prompts are no work the loss sees), every position else."""
        if self.data.masked:
            return self.run_tokens / self.train_time if self.train_time > 0 else 0.0
        return self.samples_per_s * self.data.x_train.shape[1]

    @property
    def samples_per_s(self) -> float:
        """Rows this Trainer trained per second of its own train steps (after a resume: the
        steps since, not the checkpoint's)."""
        return self.run_samples / self.train_time if self.train_time > 0 else 0.0


def _pipeline_microbatches(engine) -> int:
    """Microbatches each train_step splits its rows into (1 without pp)."""
    if engine.layout.size("pp") == 1:
        return 1
    return pipeline_options(engine.layout)[3]


__all__ = ["Callback", "Trainer", "TrainState", "configure_logging", "summary_table"]
