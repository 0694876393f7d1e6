"""An optional Weights & Biases mirror of a run's metrics (``logging.wandb: true``).

Every record :class:`~rft_jax.train.metrics_log.MetricsLog` writes goes to W&B as well, under
the same names, with the run's step as the x-axis (``step``, from 1; 0 is the evaluation before
training). The W&B run's id is kept in ``RUN_DIR/wandb_run_id`` so that a resumed training run
continues the same W&B run; ``logging.wandb_mode: offline`` writes it under ``RUN_DIR/wandb``
without a network. ``wandb`` is imported only here, only when asked for.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

RUN_ID_FILE = "wandb_run_id"


class WandbLog:
  """A W&B run mirroring a training run's metrics.

  Args:
    run_dir: the training run's directory (the W&B files and the run id go there).
    logging_config: the run's ``logging`` settings (project, entity, mode).
    config: the run's config as a plain dict (shown in W&B).
    resume: continue the W&B run recorded in ``run_dir``, if any (else a new one).
  """

  def __init__(self, run_dir: str, logging_config: Any, config: dict, *, resume: bool):
    import wandb

    id_path = os.path.join(run_dir, RUN_ID_FILE)
    if resume and os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip()
    else:
      run_id = uuid.uuid4().hex[:12]
      with open(id_path, "w") as f:
        f.write(run_id + "\n")
    self.run = wandb.init(project=logging_config.wandb_project, entity=logging_config.wandb_entity,
                          name=os.path.basename(os.path.normpath(run_dir)), dir=run_dir, id=run_id,
                          resume="allow", mode=logging_config.wandb_mode, config=config)
    self.run.define_metric("step")
    self.run.define_metric("*", step_metric="step")

  def write(self, step: int, metrics: dict[str, float]) -> None:
    self.run.log({"step": step, **metrics})

  def close(self) -> None:
    self.run.finish()
