"""``learner.entropy_method``: which entropy method runs, and the settings each method declares.

Each shipped method declares its own settings, with their defaults, meanings and checks, beside
its maths and registration (:class:`~rft_jax.rl.token_methods.cov_methods.ClipCovSettings`,
:class:`~rft_jax.rl.token_methods.cov_methods.KLCovSettings`,
:class:`~rft_jax.rl.token_methods.forking.ForkingSettings`); the config section is those
declarations side by side, so its keys stay flat and named as verl names them
(``learner.entropy_method.clip_cov_ratio``). A method of one's own with settings adds its class
to :class:`EntropyMethodConfig`'s bases.
"""

from __future__ import annotations

import dataclasses

from rft_jax.rl.checks import finite_numbers
from rft_jax.rl.token_methods.cov_methods import ClipCovSettings, KLCovSettings
from rft_jax.rl.token_methods.forking import ForkingSettings
from rft_jax.rl.token_methods.registry import configured_class

SECTION = "learner.entropy_method"


@dataclasses.dataclass
class MethodKind:
  """The method a section runs.

  Attributes:
    kind: a registered entropy method (``rft_jax.rl.token_methods``): ``none``, ``clip_cov`` or
      ``kl_cov`` (Cui et al. 2025), ``forking`` (Wang et al. 2025).
  """

  kind: str = "none"


@dataclasses.dataclass
class EntropyMethodConfig(ForkingSettings, KLCovSettings, ClipCovSettings, MethodKind):
  """One of the entropy methods the paper compares with (``rft_jax.rl.token_methods``), with the
  settings each method declares.

  Every method's settings are checked whichever runs, so a bad value in an unused one is still
  caught."""

  def __post_init__(self):
    finite_numbers(SECTION, self)
    configured_class(self, removes_tokens=False).check(self)
    self.check_clip_cov(SECTION)
    self.check_kl_cov(SECTION)
    self.check_forking(SECTION)
