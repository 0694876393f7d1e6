r"""The registry of token methods: what chooses, once per train step, which tokens the loss keeps.

A *token method* looks at the whole batch's pre-update statistics (:class:`TokenInputs`) and
returns a :class:`TokenChoice`: tokens to remove from the loss, per-token weights of the policy
loss, and tokens that get a penalty; where it has one, it also gives its own per-token policy
loss (:meth:`TokenMethod.policy_loss`). Two config keys select one method each:

* ``learner.entropy_mask.kind`` (methods with ``removes_tokens = True``): Clip_B, Clip_V, the
  sign masks, the entropy target. A token they drop leaves the loss's numerator *and* its
  token-mean denominator, as the paper's Algorithms 1 and 2 do.
* ``learner.entropy_method.kind`` (``removes_tokens = False``): Clip-Cov, KL-Cov, forking tokens.
  As the peers (verl 0.9.1, TRL 1.16.0) do, a token they drop leaves the numerator only: its
  per-token loss is multiplied by 0 and the denominator is unchanged.

The learner asks the configured methods (:func:`token_method`) and never compares names; a
config's ``kind`` is validated against this registry's keys. Adding a method is one module with a
:class:`TokenMethod` subclass under ``@register_token_method("name")``, imported by this package's
``__init__`` (docs/extending.md shows one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from rft_jax.rl.named_registry import Registry

if TYPE_CHECKING:  # annotations only
  from rft_jax.entropy import TokenStats

# The learner's config, ``rft_jax.rl.config.LearnerConfig``, named without importing it: the config
# imports this registry (to validate ``kind``), so an import back, even under TYPE_CHECKING, would
# close a cycle (tests/test_import_graph.py).
LearnerConfig = Any


class TokenInputs(NamedTuple):
  """What a method chooses from, over the whole batch, ``[B, T]`` each (``step`` a scalar).

  Attributes:
    stats: the learner's pre-update :class:`~rft_jax.entropy.TokenStats` (stop-gradient).
    sampler_logp: the sampler's log-probs of the sampled tokens.
    advantages: per-token advantages.
    response: float 1 on the valid response tokens.
    loss_mask: float 1 on the tokens in the loss so far (after the entropy mask, for an entropy
      method; ``response`` for an entropy mask).
    step: the train step (a random choice is drawn from it, so a resumed run draws the same).
  """

  stats: "TokenStats"
  sampler_logp: jax.Array
  advantages: jax.Array
  response: jax.Array
  loss_mask: jax.Array
  step: jax.Array


class TokenChoice(NamedTuple):
  """A method's choice, ``[B, T]`` each.

  Attributes:
    keep: bool, False on the tokens that leave the loss (numerator and denominator).
    weight: float32 multiplier of each token's policy loss (0: its gradient is removed).
    penalised: bool, the tokens that get the method's penalty.
    metrics: scalars the method reports (e.g. the cut it chose), logged under their names.
  """

  keep: jax.Array
  weight: jax.Array
  penalised: jax.Array
  metrics: dict[str, jax.Array]

  @classmethod
  def everything(cls, shape) -> "TokenChoice":
    """Every token kept at weight 1, none penalised: no method."""
    return cls(jnp.ones(shape, bool), jnp.ones(shape, jnp.float32), jnp.zeros(shape, bool), {})


class TokenMethod:
  """A registered token method; subclasses set the class attributes and override what they change.

  Attributes:
    name: its registry key (set by :func:`register_token_method`).
    title: its name in pages and tables (default: ``name``).
    removes_tokens: True for an entropy mask (``learner.entropy_mask.kind``), whose dropped tokens
      leave the numerator and the denominator; False for an entropy method
      (``learner.entropy_method.kind``), whose weights act on the numerator only.
    chooses_tokens: False only for ``none``: the step then needs no pre-update pass over the
      whole batch and carries no per-token arrays of the method.
    replaces_loss: its :meth:`policy_loss` is not the clipped surrogate times a weight (no dual clip).
    selected_by: None when ``kind`` names the method; else the field of its config section that
      selects it in place of ``kind`` when set (the entropy target: ``target_entropy``).
  """

  name: ClassVar[str] = ""
  title: ClassVar[str] = ""
  removes_tokens: ClassVar[bool] = False
  chooses_tokens: ClassVar[bool] = True
  replaces_loss: ClassVar[bool] = False
  selected_by: ClassVar[str | None] = None

  def __init__(self, config: "LearnerConfig"):
    self.config = config

  @classmethod
  def check(cls, section) -> None:
    """Raises ``ValueError`` (one line naming the key) if the method's config section
    (``learner.entropy_mask`` or ``learner.entropy_method``) does not suit it."""

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    """The method's choice over the whole batch."""
    return TokenChoice.everything(inputs.response.shape)

  def policy_loss(self, ppo_loss, logp, old_logp, advantages, loss_mask, weight, penalised) -> jax.Array:
    """``[b, T]`` per-token policy loss of a micro-batch: the clipped surrogate ``ppo_loss``
    times the method's ``weight`` unless the method has a loss of its own."""
    return ppo_loss * weight

  def touched(self, choice: TokenChoice) -> jax.Array:
    """``[B, T]`` the tokens the method acts on (the ``method_frac`` metric): those it zeroes."""
    return choice.weight == 0


# Every method, of both config keys (:func:`method_class` checks a name against its key's).
TOKEN_METHODS: Registry[type[TokenMethod]] = Registry("learner.entropy_mask.kind / learner.entropy_method.kind",
                                                      "token method")


def register_token_method(name: str):
  """Class decorator: registers a :class:`TokenMethod` subclass under ``name``."""

  def register(cls: type[TokenMethod]) -> type[TokenMethod]:
    TOKEN_METHODS.add(name, cls)
    cls.name = name
    cls.title = cls.__dict__.get("title") or name
    return cls

  return register


def method_names(removes_tokens: bool) -> tuple[str, ...]:
  """The ``kind`` values of the registered entropy masks (``removes_tokens``) or entropy methods,
  with ``none``."""
  return tuple(k for k, v in TOKEN_METHODS.items()
               if k == "none" or (v.removes_tokens == removes_tokens and v.selected_by is None))


def method_class(name: str, removes_tokens: bool) -> type[TokenMethod]:
  """The registered method ``kind=name`` of an entropy mask (``removes_tokens``) or entropy
  method; ``ValueError`` naming the config key if there is none."""
  key = "learner.entropy_mask.kind" if removes_tokens else "learner.entropy_method.kind"
  if name not in method_names(removes_tokens):
    other = "entropy_method.kind" if removes_tokens else "entropy_mask.kind"
    hint = f" ({name} is set by learner.{other})" if name in method_names(not removes_tokens) else ""
    raise ValueError(f"{key}={name!r} is not one of {sorted(method_names(removes_tokens))}{hint}")
  return TOKEN_METHODS[name]


def configured_class(section, removes_tokens: bool) -> type[TokenMethod]:
  """The method a config section selects: ``learner.entropy_mask`` (``removes_tokens``) or
  ``learner.entropy_method``. A method whose ``selected_by`` field is set (not None) in the
  section, else the one its ``kind`` names."""
  for cls in TOKEN_METHODS.values():
    if cls.removes_tokens == removes_tokens and cls.selected_by is not None:
      if getattr(section, cls.selected_by, None) is not None:
        return cls
  return method_class(section.kind, removes_tokens)


def configured_method(config: "LearnerConfig", removes_tokens: bool) -> TokenMethod:
  """``config``'s entropy mask (``removes_tokens``) or entropy method (:func:`configured_class`)."""
  section = config.entropy_mask if removes_tokens else config.entropy_method
  return configured_class(section, removes_tokens)(config)


def entropy_keep_mask(config: "LearnerConfig", stats: "TokenStats", sampler_logp, advantages, response,
                      step=0) -> jax.Array:
  """``[B, T]`` bool: the tokens ``config``'s entropy mask keeps in a batch (all for ``none``).

  Args:
    config: the learner's config.
    stats: ``[B, T]`` the learner's pre-update :class:`~rft_jax.entropy.TokenStats`.
    sampler_logp, advantages, response: ``[B, T]`` as :class:`TokenInputs`.
    step: the train step.
  """
  inputs = TokenInputs(stats, sampler_logp, advantages, response, response, jnp.asarray(step))
  return configured_method(config, removes_tokens=True).choose(inputs).keep


@register_token_method("none")
class NoTokenMethod(TokenMethod):
  """No method: every token in the loss at weight 1."""

  chooses_tokens = False

