"""Verifiable rewards for math: text in, number out.

``extract`` (the last ``\\boxed{}``), ``verify`` (math-verify equivalence under a
per-check time limit), ``pool`` (worker processes that are killed on timeout),
``schemes`` (registered reward schemes, DAPO over-long penalty, ``RewardConfig``) and
``score`` (``score_batch``). Nothing here imports the rest of the project.
"""

from rft_jax.rewards.extract import EXTRACTORS
from rft_jax.rewards.extract import last_answer_line
from rft_jax.rewards.extract import last_boxed
from rft_jax.rewards.extract import last_unboxed_answer
from rft_jax.rewards.pool import OVER_BUDGET
from rft_jax.rewards.pool import Outcome
from rft_jax.rewards.pool import TimeLimitedPool
from rft_jax.rewards.schemes import SCHEMES
from rft_jax.rewards.schemes import RewardConfig
from rft_jax.rewards.schemes import RewardScheme
from rft_jax.rewards.schemes import binary_reward
from rft_jax.rewards.schemes import dapo_overlong_penalty
from rft_jax.rewards.schemes import paper_appendix_b_reward
from rft_jax.rewards.score import RewardResult
from rft_jax.rewards.score import score_batch
from rft_jax.rewards.verify import Verdict
from rft_jax.rewards.verify import check_equivalence
from rft_jax.rewards.verify import check_many
from rft_jax.rewards.verify import check_within_budget
from rft_jax.rewards.verify import default_pool
from rft_jax.rewards.verify import is_equivalent
from rft_jax.rewards.verify import make_pool
from rft_jax.rewards.verify import normalize_answer

__all__ = [
    "EXTRACTORS",
    "OVER_BUDGET",
    "Outcome",
    "RewardConfig",
    "RewardResult",
    "RewardScheme",
    "SCHEMES",
    "TimeLimitedPool",
    "Verdict",
    "binary_reward",
    "check_equivalence",
    "check_many",
    "check_within_budget",
    "dapo_overlong_penalty",
    "default_pool",
    "is_equivalent",
    "last_answer_line",
    "last_boxed",
    "last_unboxed_answer",
    "make_pool",
    "normalize_answer",
    "paper_appendix_b_reward",
    "score_batch",
]
