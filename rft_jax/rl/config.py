"""Configuration of the learner, with the paper's symbols (validated on construction).

Part of the run's single config tree (``rft_jax.train.config``): YAML and dotted CLI
overrides are merged into these dataclasses, so a typo or a wrong type is an error.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rft_jax.entropy.clipping import CLIP_V_MAX_FRAC, LOGP_SOURCES, SAMPLES
from rft_jax.models.config import DTYPES
from rft_jax.rl.advantages.algorithms import Algorithm, algorithm
from rft_jax.rl.checks import choice, finite_numbers, positive
from rft_jax.rl.losses import AGGREGATIONS, KL_ESTIMATORS
from rft_jax.rl.objectives import Objective, objective
from rft_jax.rl.optimizer import OptimizerConfig, optimizer_config
from rft_jax.rl.rollout_correction import IMPORTANCE_LEVELS, RejectionBound, rejection_bounds
from rft_jax.rl.token_methods import configured_class, method_class
from rft_jax.rl.token_methods.method_settings import EntropyMethodConfig

REF_DTYPES = (None, *DTYPES)


@dataclasses.dataclass
class EntropyMaskConfig:
  """Which tokens the entropy-discriminator mask removes from the loss.

  Attributes:
    kind: a registered entropy mask (``rft_jax.rl.token_methods``): ``none``, ``clip_b``
      (Algorithm 1), ``clip_v`` (Algorithm 2) or ``sign`` (the Figure 1 masks on the sign of S_*).
    mu_low: lower cut mu^- in batch standard deviations (None: the kind's default,
      2.5 for Clip_B and 8.5 for Clip_V).
    mu_high: upper cut mu^+ (None: no upper cut, as the released configs).
    samples: which samples may be masked: ``negative`` (A < 0), ``positive``, ``all``.
    max_frac: Clip_V's cap on the masked share of valid tokens (None: its default 1e-4;
      set 1.0 for no cap). At least the single most extreme token may be masked, as in the
      authors' code.
    logp_source: which log-probs of the sampled token form S_* for the mask: ``learner``
      (default: recomputed by the learner, like the entropy) or ``sampler`` (the rollout's, as
      the authors' Clip_B; see ``rft_jax.entropy.clipping``).
    sign / action: for ``kind=sign``: ``positive``/``negative`` S_*; ``keep`` (only those tokens
      of the chosen samples), ``drop`` (all but those) or ``only`` (those tokens and nothing else
      of the batch; ``rft_jax.entropy.clipping.discriminator_sign_mask``).
    target_entropy: with ``clip_b`` / ``clip_v``, choose the cut ``mu_low`` per batch to hold
      the policy's mean token entropy near this value (``rft_jax.rl.token_methods.
      entropy_target``; None: the fixed cut). target_band: how far below the target, as a
      share of it, the most entropy-raising cut is taken (the asked effect grows linearly
      from the target down to there).
  """

  kind: str = "none"
  mu_low: Optional[float] = None
  mu_high: Optional[float] = None
  samples: str = "negative"
  max_frac: Optional[float] = None
  sign: str = "positive"
  action: str = "drop"
  logp_source: str = "learner"
  target_entropy: Optional[float] = None
  target_band: float = 0.1

  def __post_init__(self):
    finite_numbers("learner.entropy_mask", self)
    if self.target_entropy is not None:
      positive("learner.entropy_mask.target_entropy", self.target_entropy)
    positive("learner.entropy_mask.target_band", self.target_band)
    configured_class(self, removes_tokens=True).check(self)
    choice("learner.entropy_mask.samples", self.samples, SAMPLES)
    choice("learner.entropy_mask.sign", self.sign, ("positive", "negative"))
    choice("learner.entropy_mask.action", self.action, ("keep", "drop", "only"))
    choice("learner.entropy_mask.logp_source", self.logp_source, LOGP_SOURCES)
    if self.max_frac is not None and not 0.0 <= self.max_frac <= 1.0:
      raise ValueError(f"learner.entropy_mask.max_frac must be in [0, 1], got {self.max_frac!r}")
    for name in ("mu_low", "mu_high"):
      if getattr(self, name) is not None:
        positive(f"learner.entropy_mask.{name}", getattr(self, name), allow_zero=True)

  @property
  def resolved_mu_low(self) -> float | None:
    """``mu_low``, else the default of a mask with a cut (None for one without)."""
    if self.mu_low is not None:
      return self.mu_low
    return getattr(method_class(self.kind, removes_tokens=True), "default_mu_low", None)

  @property
  def resolved_max_frac(self) -> float:
    return CLIP_V_MAX_FRAC if self.max_frac is None else self.max_frac


@dataclasses.dataclass
class RolloutCorrectionConfig:
  """Correction of the sampler-learner mismatch (``rft_jax.rl.rollout_correction``): verl 0.9.1's
  ``algorithm.rollout_correction`` in its decoupled mode (the learner recomputes the old
  log-probs; verl's ``bypass_mode`` and ``loss_type`` are not offered). All off by default.

  Attributes (each with verl 0.9.1's key under ``algorithm.rollout_correction.``):
    importance_sampling (``rollout_is``): ``token`` or ``sequence``: truncated importance weights
      pi_old / pi_rollout (of the token, or the product over the sequence) multiply each token's
      PPO surrogate, detached; None: off.
    importance_weight_cap (``rollout_is_threshold``, a number or the upper of ``"lower_upper"``):
      the cap C of the weights.
    importance_weight_floor (the lower of ``rollout_is_threshold: "lower_upper"``): IcePop, weights
      outside [floor, C] are 0 instead of truncated (the tokens stay in the denominator); None: TIS.
    normalize_importance_weights (``rollout_is_batch_normalize``): divide the weights by their batch
      mean (of the tokens, or of the sequences' weights).
    rejection (``rollout_rs``): comma-separated rejection options (``token_k1`` ... ``seq_max_k3``,
      ``rft_jax.rl.rollout_correction.REJECTION_OPTIONS``); rejected tokens leave the loss mask,
      numerator and denominator; None: off.
    rejection_bounds (``rollout_rs_threshold``): one bound for all options or one per option,
      comma-separated; ``k1``: ``"lower_upper"`` ratio bounds, or the upper one (lower: its
      reciprocal); ``k2`` / ``k3``: the upper bound of the divergence.
    diagnostics (verl: the section set with ``rollout_is`` and ``rollout_rs`` null): log the
      ``rollout_corr/`` metrics without correcting anything (on whenever a correction is).
  """

  importance_sampling: Optional[str] = None
  importance_weight_cap: float = 2.0
  importance_weight_floor: Optional[float] = None
  normalize_importance_weights: bool = False
  rejection: Optional[str] = None
  rejection_bounds: Optional[str] = None
  diagnostics: bool = False

  def __post_init__(self):
    key = "learner.rollout_correction"
    finite_numbers(key, self)
    choice(f"{key}.importance_sampling", self.importance_sampling, (None, *IMPORTANCE_LEVELS))
    positive(f"{key}.importance_weight_cap", self.importance_weight_cap)
    if self.importance_weight_floor is not None and not 0 < self.importance_weight_floor <= self.importance_weight_cap:
      raise ValueError(f"{key}.importance_weight_floor={self.importance_weight_floor!r} must be in "
                       f"(0, importance_weight_cap={self.importance_weight_cap}]")
    if self.rejection is None and self.rejection_bounds is not None:
      raise ValueError(f"{key}.rejection_bounds={self.rejection_bounds!r} without {key}.rejection")
    if self.rejection is not None:
      try:
        rejection_bounds(self.rejection, self.rejection_bounds)
      except ValueError as error:
        raise ValueError(f"{key}.rejection={self.rejection!r} with rejection_bounds={self.rejection_bounds!r}: "
                         f"{error}") from None

  @property
  def enabled(self) -> bool:
    """Whether the learner computes the correction (or only its metrics) at all."""
    return self.importance_sampling is not None or self.rejection is not None or self.diagnostics

  @property
  def rejection_table(self) -> tuple[RejectionBound, ...]:
    return rejection_bounds(self.rejection, self.rejection_bounds) if self.rejection is not None else ()

  @property
  def token_local(self) -> bool:
    """Whether each token's correction depends on that token alone (token weights, no rejection,
    no batch normalisation): then micro-batches sharing their forward pass can apply it."""
    return (self.importance_sampling in (None, "token") and self.rejection is None
            and not self.normalize_importance_weights)


@dataclasses.dataclass
class LearnerConfig:
  """The GRPO learner.

  Attributes:
    advantage: estimator name: group estimators (``grpo``, ``drgrpo``, ``rloo``), or ``gae``:
      PPO with a learned critic (``rft_jax.rl.advantages.critic``, the run's ``critic`` settings), token-level
      GAE advantages whitened over the batch (``rft_jax.rl.advantages.gae``).
    advantage_eps: epsilon of the group z-score; advantage_ddof: its std's ddof.
    objective: the policy's surrogate loss, a registered objective (``rft_jax.rl.objectives``):
      ``ppo`` (per-token ratio, the paper's) or ``gspo`` (sequence-level ratio).
    eps_low / eps_high: clip range [1 - eps_low, 1 + eps_high] of the ratio r (None: the
      objective's default, 0.2 / 0.2 for ``ppo``, 3e-4 / 4e-4 for ``gspo``).
    dual_clip: dual-clip constant c > 1 for A < 0 (None: off; ``ppo`` only).
    loss_agg: loss aggregation (``token-mean``, ``seq-mean-token-mean``, ...).
    kl_coef / kl_estimator: KL-to-reference penalty beta (0: off) and its estimator. The
      reference is a frozen copy of the starting parameters (``rft_jax.rl.reference``).
    ref_dtype: storage dtype of the reference parameters: ``float32``, ``bfloat16`` (half the
      memory of a float32 copy) or None (the policy parameters' dtype).
    entropy_coef: entropy bonus coefficient (0: off).
    entropy_mask: the Clip_B / Clip_V / sign mask.
    entropy_method: Clip-Cov, KL-Cov or forking tokens (the paper's Table 3 comparisons).
    rollout_correction: importance weights and rejection for the sampler-learner log-prob
      mismatch (verl's ``algorithm.rollout_correction``; :class:`RolloutCorrectionConfig`).
    beta_rank: the unlikeliness reward's coefficient (He, Fried, Welleck 2025;
      ``rft_jax.rl.advantages.unlikeliness``): within each group, rewards of correct samples are scaled by
      ``1 - beta_rank * rank / n`` by likelihood under the sampling policy (0: off).
    optim: AdamW, its learning rate eta and schedule (``rft_jax.rl.optimizer.OptimizerConfig``).
    mini_batches: optimizer steps per batch of rollouts; ppo_epochs: passes.
    micro_batch_size: sequences per gradient-accumulation step (per mini-batch).
    micro_batch_tokens: micro-batches by tokens instead (``rft_jax.rl.token_batches``): each
      mini-batch's rows packed, several sequences per row, into micro-batches of about this many
      token slots (``micro_batch_tokens // L`` rows of the batch's width ``L``, at least one per
      data-parallel device); the padding of long-tailed rollouts is not computed, the results
      are those of row micro-batches. None: row micro-batches of ``micro_batch_size``.
    temperature: sampling temperature T of the rollouts; every statistic and log p
      is of softmax(z / T). None: 1.0 standalone; in a run, taken from sampling.temperature.
    stats_chunk_size: positions per chunk of ``token_stats``.
    forecast_every: every this many steps, measure the entropy change of the update
      on the same batch and its exact first-order forecast (one extra forward pass with
      tangents and a copy of the parameters; 0: never).
    router_aux_loss_coef: an MoE policy's load-balancing loss weight in the learner's loss (as
      transformers computes the loss; ``rft_jax.rl.learner.routing``). None: the model
      config's ``router_aux_loss_coef``; 0: off (still logged). Ignored on dense models.
    router_z_loss_coef: the router z-loss weight (ST-MoE; 0: off, still logged).
    routing_replay: rollout routing replay (R3): the learner's forward passes route each token
      by the experts the sampler chose for it (the batch's ``expert_ids``, recorded by the
      sampler), the routing weights still those of the live router. MoE models only; needs
      ``sampling.record_routing`` (refused when the config loads without it).
  """

  advantage: str = "grpo"
  advantage_eps: float = 1e-6
  advantage_ddof: int = 1
  objective: str = "ppo"
  eps_low: Optional[float] = None
  eps_high: Optional[float] = None
  dual_clip: Optional[float] = None
  loss_agg: str = "token-mean"
  max_len: Optional[int] = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  ref_dtype: Optional[str] = None
  entropy_coef: float = 0.0
  entropy_mask: EntropyMaskConfig = dataclasses.field(default_factory=EntropyMaskConfig)
  entropy_method: EntropyMethodConfig = dataclasses.field(default_factory=EntropyMethodConfig)
  rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
  beta_rank: float = 0.0
  optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  mini_batches: int = 1
  ppo_epochs: int = 1
  micro_batch_size: int = 8
  micro_batch_tokens: Optional[int] = None
  temperature: Optional[float] = None
  stats_chunk_size: int = 512
  forecast_every: int = 0
  router_aux_loss_coef: Optional[float] = None
  router_z_loss_coef: float = 0.0
  routing_replay: bool = False

  def __post_init__(self):
    if isinstance(self.entropy_mask, dict):
      self.entropy_mask = EntropyMaskConfig(**self.entropy_mask)
    if isinstance(self.entropy_method, dict):
      self.entropy_method = EntropyMethodConfig(**self.entropy_method)
    if isinstance(self.rollout_correction, dict):
      self.rollout_correction = RolloutCorrectionConfig(**self.rollout_correction)
    self.optim = optimizer_config(self.optim, "learner.optim")
    finite_numbers("learner", self)
    algorithm(self.advantage)
    entry = objective(self.objective)
    choice("learner.loss_agg", self.loss_agg, AGGREGATIONS)
    choice("learner.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    choice("learner.ref_dtype", self.ref_dtype, REF_DTYPES)
    if self.temperature is not None:
      positive("learner.temperature", self.temperature)
    for name in ("mini_batches", "ppo_epochs", "micro_batch_size", "stats_chunk_size"):
      positive(f"learner.{name}", getattr(self, name))
    for name in ("eps_low", "eps_high", "kl_coef", "entropy_coef", "forecast_every", "router_aux_loss_coef",
                 "router_z_loss_coef"):
      if getattr(self, name) is not None:
        positive(f"learner.{name}", getattr(self, name), allow_zero=True)
    if self.micro_batch_tokens is not None and (isinstance(self.micro_batch_tokens, bool) or
                                                not isinstance(self.micro_batch_tokens, int) or
                                                self.micro_batch_tokens <= 0):
      raise ValueError(f"learner.micro_batch_tokens must be a positive integer or null, got {self.micro_batch_tokens!r}")
    if self.dual_clip is not None and self.dual_clip <= 1:
      raise ValueError(f"learner.dual_clip must be > 1, got {self.dual_clip}")
    if self.dual_clip is not None and not entry.takes_dual_clip:
      raise ValueError(f"learner.dual_clip={self.dual_clip} with learner.objective={self.objective}: "
                       "that objective has no dual clip; set learner.dual_clip=null")
    for method in (configured_class(self.entropy_mask, True), configured_class(self.entropy_method, False)):
      if method.replaces_loss and not entry.replaceable:
        raise ValueError(f"learner.objective={self.objective} with {method.name}: that method "
                         "replaces the PPO loss with its own; set learner.objective=ppo")
      if self.dual_clip is not None and method.replaces_loss:
        raise ValueError(f"learner.dual_clip={self.dual_clip} with {method.name}: that method's loss "
                         "has no dual clip; set learner.dual_clip=null")
    if not 0 <= self.beta_rank <= 1:
      raise ValueError(f"learner.beta_rank must be in [0, 1], got {self.beta_rank!r}")
    if self.rollout_correction.rejection is not None and not self.algorithm.takes_rejection:
      # e.g. GAE: verl rejects before its advantages (its recursion and whitening skip the rejected
      # tokens); here the advantages are made before the learner's pre-update log-probs exist
      raise ValueError(f"learner.rollout_correction.rejection={self.rollout_correction.rejection!r} with "
                       f"learner.advantage={self.advantage} is not supported (verl computes GAE over the "
                       "kept tokens only)")

  @property
  def policy_objective(self) -> Objective:
    """The entry of ``objective`` (``rft_jax.rl.objectives``)."""
    return objective(self.objective)

  @property
  def resolved_eps_low(self) -> float:
    """``eps_low``, else the objective's default (the config keeps None, so that a later
    ``objective`` override still gets its own clip)."""
    return self.policy_objective.eps_low if self.eps_low is None else self.eps_low

  @property
  def resolved_eps_high(self) -> float:
    return self.policy_objective.eps_high if self.eps_high is None else self.eps_high

  @property
  def algorithm(self) -> Algorithm:
    """The entry of ``advantage`` (``rft_jax.rl.advantages.algorithms``): e.g. whether PPO's critic is needed."""
    return algorithm(self.advantage)

  @property
  def sampling_temperature(self) -> float:
    return 1.0 if self.temperature is None else self.temperature
