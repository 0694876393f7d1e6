"""The training loop: sample, reward, learn, log, evaluate, checkpoint.

Each step draws ``data.prompts_per_step`` prompts, samples ``sampling.n`` completions
each with the learner's current parameters (in place, on the learner's mesh), scores
them, turns rewards into group advantages (optionally dropping zero-variance groups and
refilling, DAPO's dynamic sampling), runs one learner step and logs every metric, with
the seconds spent in each phase (``time_sample``, ``time_reward``, ``time_learner``, and
``time_eval`` on evaluation steps). The
sampler's randomness is derived from ``seed`` and the step, and the prompt stream's
position is checkpointed, so a resumed run repeats exactly what an uninterrupted one
would have done. What a run builds once, before its first step, is
:func:`rft_jax.train.run_setup.build_run`'s. Steps are numbered from 1 in everything a run
writes and says (:mod:`rft_jax.train.step_numbers`); inside the loop a step's ``index`` (its
number minus one) seeds its sampling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from typing import Any

import jax
import numpy as np

from rft_jax.parallel import is_main_process, sync_processes
from rft_jax.rl.advantages.algorithms import AdvantageInputs, CriticRun
from rft_jax.rl.advantages.critic import ActorCriticState
from rft_jax.train.checkpoint import RunCheckpointer, nonfinite_arrays
from rft_jax.train.compilation_cache import CacheUse, persistent_compilation_cache, run_cache_dir
from rft_jax.train.config import TrainConfig
from rft_jax.train.debug_log import debug_log
from rft_jax.train.errors import NonFiniteError, Preempted, WriteError
from rft_jax.train.evaluate import evaluate_problems
from rft_jax.train.learning_signal import NoSignalWarning
from rft_jax.train.metric_names import logged_name
from rft_jax.train.metrics_log import JsonlFile, MetricsLog, NullLog
from rft_jax.train.preemption import StopSignals
from rft_jax.train.preflight import validate_for_training
from rft_jax.train.resolve import sampling_params
from rft_jax.train.run_setup import Run, build_run
from rft_jax.train.run_dir import RunDirLock, finished_steps, prepare_run_dir
from rft_jax.train.status import logger
from rft_jax.train.step_rollouts import (
    SampledRound,
    StepRollouts,
    chosen_batch,
    check_reward_failures,
    gather,
    row_advantages,
    select_groups,
)
from rft_jax.train.wandb_log import WandbLog


def sample_round(run: Run, state, prompts: list, seed: int) -> SampledRound:
  """Stage 1, sample and score: rollouts of ``prompts`` with the policy of ``state``, decoded and
  rewarded, by the run's rollout engine (:mod:`rft_jax.train.rollout_engine`)."""
  run.rollouts.update_weights(run.learner.model(state))
  return run.rollouts.sample(prompts, sampling_params(run.config, run.stop_ids), seed)


def sample_rounds(run: Run, state, step: int) -> list[SampledRound]:
  """Stage 1 for the step of index ``step`` (from 0: the step numbered ``step + 1``): its
  prompts' round, then, with dynamic sampling, refills until enough groups have rewards that
  differ (at most ``max_refills``)."""
  cfg = run.config
  seed = cfg.seed * 1_000_003 + step * 101
  rounds = [sample_round(run, state, next(run.stream), seed=seed)]
  while (cfg.dynamic_sampling and len(rounds) <= cfg.max_refills
         and sum(r.varied_groups(cfg.sampling.n) for r in rounds) < cfg.data.prompts_per_step):
    rounds.append(sample_round(run, state, next(run.stream), seed=seed + len(rounds)))
  check_reward_failures([r.scored for r in rounds], step + 1, cfg.rewards)
  return rounds


def critic_run(run: Run, critic_state) -> CriticRun | None:
  """PPO's critic in the run at ``critic_state`` (None without a critic)."""
  if run.critic is None:
    return None
  return CriticRun(run.critic, critic_state, run.config.critic.gamma, run.config.critic.lam)


def step_rollouts(run: Run, state, step: int) -> StepRollouts:
  """The learner's batch of the step of index ``step`` (from 0): stages 1-3 of a step."""
  cfg = run.config
  n = cfg.sampling.n
  rounds = sample_rounds(run, state, step)  # 1. sample and score
  chosen = select_groups(rounds, n, cfg.data.prompts_per_step, cfg.dynamic_sampling)  # 2. select
  # Device arrays where the sampler left them: the learner lays them out on its mesh.
  batch = chosen_batch([(g.round.rollouts, g.rows) for g in chosen])
  rewards = gather(chosen, "reward").astype(np.float32)
  correct = gather(chosen, "correct").astype(bool)
  inputs = AdvantageInputs(rewards, correct, batch.input_ids, batch.attention_mask, batch.response_mask,
                           batch.sampler_logp)
  critic = critic_run(run, state.critic if run.critic is not None else None)
  result = cfg.learner.algorithm.advantages(inputs, n, cfg.learner, critic)  # 3. advantages
  batch = batch.replace(advantages=result.advantages)
  return StepRollouts(rounds, chosen, rewards, correct, batch, result.critic_targets)


def train_step(run: Run, state, index: int, rollouts_log=None) -> tuple[Any, dict[str, float]]:
  """One step of the loop, the step of ``index`` (from 0; numbered ``index + 1``): sample and
  score, select, advantages (:func:`step_rollouts`), learn, log. Returns the new state and every
  metric of the step. The completions of step 1 and of every ``log_rollouts_every``-th step after
  it go to ``rollouts_log`` (a :class:`~rft_jax.train.metrics_log.JsonlFile`), when given."""
  rollouts = step_rollouts(run, state, index)
  batch = rollouts.batch
  every = run.config.log_rollouts_every
  policy, critic_state = (state.policy, state.critic) if run.critic is not None else (state, None)
  t0 = time.perf_counter()  # 4. learn
  logged = bool(every and index % every == 0)
  if logged or run.agent is not None:  # on every process: the per-row values are collectives
    policy, metrics, row_stats = run.learner.step(policy, batch, rows=True)
    token_entropy = row_stats.pop("token_entropy")
    if run.agent is not None:
      metrics.update(run.agent.entropy_metrics(rollouts, token_entropy, run.config.rollout.max_turns))
    row_stats["advantage"] = row_advantages(batch)
    if logged and rollouts_log is not None:
      rollouts_log.write(rollouts.records(run.tokenizer, index + 1, row_stats))
  else:
    policy, metrics = run.learner.step(policy, batch)
  learn_time = time.perf_counter() - t0
  state = policy
  if run.critic is not None:  # the algorithm's critic step on the same rollouts
    t1 = time.perf_counter()
    critic_state, critic_metrics = run.config.learner.algorithm.critic_step(
        critic_run(run, critic_state), batch, rollouts.critic_targets)
    metrics.update(critic_metrics, time_critic=time.perf_counter() - t1)
    state = ActorCriticState(policy=policy, critic=critic_state)
  metrics.update(rollouts.metrics(run.config.sampling.n), time_learner=learn_time)  # 5. log
  return state, metrics


def _checkpoint_meta(run: Run, step: int) -> dict:
  return {"step": step, "seed": run.config.seed, "data": run.stream.get_state()}


def train(cfg: TrainConfig, *, resume: bool = True, overwrite: bool = False,
          allow_config_change: bool = False) -> dict[str, float]:
  """Runs (or resumes) a training run in ``cfg.run_dir``; returns the last step's metrics and
  ``steps_done``, the steps the run holds now (fewer than ``cfg.steps`` if the data ran out).

  With ``resume`` (the default) a run directory that holds checkpoints continues from
  the latest one that restores; the metrics of the resumed steps equal those of an
  uninterrupted run. Without it, a directory holding an earlier run is refused unless
  ``overwrite``; a resume with a config that differs in what the run computes is refused
  unless ``allow_config_change`` (:func:`rft_jax.train.run_dir.prepare_run_dir`). A resumed run
  that already holds ``cfg.steps`` steps or more has nothing to do: no step runs, none of its
  files is written (``config.yaml``, metrics, checkpoints) and only ``steps_done`` is returned.

  Faults end the run with a :class:`rft_jax.train.errors.RunError` naming the cause, after
  saving the last completed step when that is possible: a second trainer on the directory,
  a failed write (metrics, TensorBoard; a checkpoint's background save, judged after the step
  that follows it), ``max_nonfinite_steps`` skipped steps in a row, a step whose rewards failed
  beyond ``rewards.max_error_fraction``, a checkpoint to resume with non-finite parameters,
  SIGTERM / SIGINT (after finishing the step), an evaluation that fails. Running out of data
  (``data.epochs``) ends the run early with a checkpoint and a message. The details behind a
  fault's one line go to ``RUN_DIR/debug.log`` (:mod:`rft_jax.train.debug_log`).

  On several processes (one per host) every process runs this with the same config: all
  of them sample, score, learn and checkpoint (orbax coordinates the writes); only
  process 0 takes the directory's lock and writes ``config.yaml``, the metrics and the
  progress bar.
  """
  main = is_main_process()
  inputs = validate_for_training(cfg, jax.device_count())
  logger.info("config checked: %d steps of %d prompts x %d samples into %s", cfg.steps,
              cfg.data.prompts_per_step, cfg.sampling.n, cfg.run_dir)
  with (RunDirLock(cfg.run_dir) if main else contextlib.nullcontext()), StopSignals() as signals, \
       persistent_compilation_cache(run_cache_dir(cfg.run_dir, cfg.compilation_cache_dir)) as cache:
    # A run whose checkpoints reach cfg.steps may have nothing to do: its directory is checked, not
    # written, until its latest checkpoint that restores says whether steps are left.
    maybe_finished = finished_steps(cfg, resume=resume and not overwrite) is not None
    prepare = dict(resume=resume, overwrite=overwrite, allow_config_change=allow_config_change)
    if main:
      prepare_run_dir(cfg, **prepare, check_only=maybe_finished)
    sync_processes("rft_jax.prepare_run_dir")
    with debug_log(cfg.run_dir, jax.process_index()):
      run, state = build_run(cfg, inputs)
      checkpointer = RunCheckpointer(os.path.join(cfg.run_dir, "checkpoints"), keep=cfg.keep_checkpoints)
      start = 0
      if resume and checkpointer.latest_step() is not None:
        state, meta, start = checkpointer.restore(state)
        _check_restored(state, checkpointer, start)
        if start >= cfg.steps:  # finished: nothing to do, nothing written
          checkpointer.close()
          return {"steps_done": start}
        run.stream.set_state(meta["data"])
        if main:
          logger.info("resumed from step %d of %s", start, cfg.run_dir)
      if maybe_finished and main:  # it was not: its latest checkpoints did not restore
        prepare_run_dir(cfg, **prepare)
      resume_from = start if start else None
      mirror = (WandbLog(cfg.run_dir, cfg.logging, dataclasses.asdict(cfg), resume=resume)
                if main and cfg.logging.wandb else None)
      log = MetricsLog(cfg.run_dir, resume_from_step=resume_from, mirror=mirror) if main else NullLog()
      completions = {name: JsonlFile(os.path.join(cfg.run_dir, f"{name}.jsonl"), resume_from_step=resume_from)
                     for name, on in (("rollouts", cfg.log_rollouts_every),
                                      ("eval_completions", cfg.eval.save_completions and evaluates(run)))
                     if on and main}
      try:
        return _run_steps(run, state, start, checkpointer, log, signals, completions, cache)
      finally:
        run.close()


def _run_steps(run: Run, state, start: int, checkpointer: RunCheckpointer, log, signals,
               completions: dict[str, JsonlFile], cache: CacheUse) -> dict[str, float]:
  """The loop over steps. ``completions``: the run's ``rollouts`` and ``eval_completions`` JSONL
  files (either absent when off, both on processes other than 0); ``cache``: the compilation
  cache's use, reported after the first step."""
  cfg = run.config
  metrics: dict[str, float] = {}
  progress = _progress(cfg, start, enabled=is_main_process())
  done = saved = start  # steps in `state`; steps in the latest checkpoint (step numbers, from 1)
  skipped_in_row = skipped_total = 0

  def save(step: int) -> None:
    """Starts saving ``step``; :func:`committed` reports it once it is on disk."""
    nonlocal saved
    committed()  # a save still in flight first
    checkpointer.save(step, state, _checkpoint_meta(run, step))
    log.flush()
    for f in completions.values():
      f.flush()
    saved = step

  def committed() -> None:
    """Waits for the save in flight: a status line once it is committed, else the run stops
    with :class:`WriteError` (before the next step or the metrics write, on a full disk)."""
    step = checkpointer.wait()
    if step is not None:
      logger.info("checkpoint of step %d saved in %s", step, checkpointer.directory)

  evaluating = evaluates(run)  # else no evaluation runs and none is logged
  no_signal = NoSignalWarning(cfg, start)
  try:
    if evaluating and cfg.eval.at_start and start == 0:  # step 0: the start
      log.write(0, _timed_evaluation(run, state, 0, completions.get("eval_completions")))
    for index in range(start, cfg.steps):
      step = index + 1  # the step's number: once it is done, `step` steps are done
      try:
        started = time.perf_counter()
        state, metrics = train_step(run, state, index, completions.get("rollouts"))
        committed()  # the save started after the previous step: judged before anything else
        if index == start:
          logger.info("first step done in %.0f s (compiling the sampler and the learner step; "
                      "%d programs loaded from the compilation cache, %.0f s of compiling saved)",
                      time.perf_counter() - started, cache.hits, cache.seconds_saved)
      except StopIteration:
        logger.warning("the training data ran out (data.epochs=%s) after step %d; stopping with a "
                       "checkpoint of step %d", cfg.data.epochs, done, done)
        break
      done = step
      skipped = bool(metrics.get("nonfinite_skipped", 0.0))
      skipped_in_row = skipped_in_row + 1 if skipped else 0
      skipped_total += skipped
      metrics["nonfinite_skipped_total"] = float(skipped_total)
      no_signal.update(step, metrics)
      if evaluating and cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.steps):
        try:
          metrics.update(_timed_evaluation(run, state, step, completions.get("eval_completions")))
          logger.info("evaluation after step %d: %s", step, ", ".join(
              f"{logged_name(k)} {v:.3f}" for k, v in metrics.items() if k.startswith("eval_") and "@" in k))
        except Exception:
          log.write(step, metrics)  # the step's own metrics; its checkpoint follows below
          raise
      if index == start:
        metrics.update({f"data_{k}": float(v) for k, v in run.data_report.items()})
      log.write(step, metrics)
      progress.update(1)
      progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}", entropy=f"{metrics['entropy']:.3f}")
      if skipped_in_row >= cfg.max_nonfinite_steps:
        kept = step - skipped_in_row
        raise NonFiniteError(
            f"steps {kept + 1}-{step}: the loss or gradient norm was not finite "
            f"{skipped_in_row} times in a row (max_nonfinite_steps={cfg.max_nonfinite_steps}); each "
            f"was skipped, the parameters are " + (f"those after step {kept}" if kept else "the starting ones"))
      stop = signals.requested()
      if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps or stop:
        save(done)
      if stop:
        committed()
        raise Preempted(f"stopped by {signal.Signals(stop).name} after step {done}: checkpoint of "
                        f"step {done} in {checkpointer.directory}; rerun the command to resume", stop)
    if done > saved:
      save(done)
    committed()
  except BaseException as exc:
    if done > saved and not isinstance(exc, (WriteError, Preempted)):
      _save_after_error(lambda step: (save(step), committed()), done, state)
    progress.close()
    _close_quietly(checkpointer.close, log.close, *(f.close for f in completions.values()))
    raise
  progress.close()
  checkpointer.close()
  log.close()
  for f in completions.values():
    f.close()
  return {**metrics, "steps_done": done}


def evaluates(run: Run) -> bool:
  """Whether the run's evaluations have anything to evaluate: evaluation on (``eval.every`` or
  ``eval.at_start``) and a validation split (``data.val_size``) or ``eval.sets``. Without, no
  evaluation runs, none is logged and no ``eval_completions.jsonl`` is written."""
  cfg = run.config
  return bool((cfg.eval.every or cfg.eval.at_start) and (run.validation or cfg.eval.sets))


def _check_restored(state, checkpointer: RunCheckpointer, step: int) -> None:
  """Refuses to resume from parameters that hold NaN or infinity (a checkpoint written past
  :meth:`RunCheckpointer.save`'s check, by an older version or another program): named here,
  not blamed on the first step that trains on them."""
  bad = nonfinite_arrays(state.params)
  if bad:
    checkpointer.close()
    raise NonFiniteError(
        f"checkpoint {os.path.join(checkpointer.directory, str(step))} (step {step}) holds NaN or "
        f"infinite parameters in {len(bad)} array(s), e.g. params{bad[0]}; move it out of "
        f"{checkpointer.directory} to resume from the one before")


def _save_after_error(save, step: int, state) -> None:
  """Saves the last completed step of a run that is failing, saying so; a save that cannot be
  made (e.g. the state's buffers were donated to the failing step) is reported, not raised."""
  if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
    logger.error("the state after step %d is gone with the failing step; not saved", step)
    return
  try:
    save(step)
    logger.error("saved a checkpoint of step %d before stopping on the error below", step)
  except Exception as exc:  # the original error is the one to report
    logger.error("could not save step %d before stopping: %s", step, exc)


def _close_quietly(*closers) -> None:
  for close in closers:
    try:
      close()
    except Exception as exc:  # an error is already on its way out
      logger.error("while stopping: %s", exc)


def _timed_evaluation(run: Run, state, step: int, completions_log=None) -> dict[str, float]:
  """The evaluation after ``step`` (0: before training); its answers go to ``completions_log``."""
  t0 = time.perf_counter()
  records = [] if completions_log is not None else None
  metrics = evaluate_problems(run, state, records)
  if records:
    completions_log.write([{"step": step, **r} for r in records])
  metrics["time_eval"] = time.perf_counter() - t0
  return metrics


def _progress(cfg: TrainConfig, start: int, enabled: bool = True):
  from tqdm.auto import tqdm

  return tqdm(total=cfg.steps, initial=start, desc=os.path.basename(cfg.run_dir.rstrip("/")),
              disable=not (cfg.progress and enabled), dynamic_ncols=True)
