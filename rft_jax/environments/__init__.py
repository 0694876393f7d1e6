"""Text environments for multi-turn RL, with skyrl-gym's API, hosted in worker processes.

``base`` (``Environment``: ``init`` / ``step`` / ``close``; ``check_step_output``), ``registry``
(environments by name: builtins, ``skyrl_gym:<id>``, ``package.module:ClassName``),
``guess_number`` (a builtin: guess a number told higher or lower), ``tool_use`` (the ``tools``
builtin: Qwen-format tool calls run in the worker, then a final answer graded), ``workers`` (one
environment per trajectory in killable worker processes, each call bounded in time; futures of
outcomes; timeouts recovered by replay), ``faults`` (a step's outcomes counted, and the bound on
the fraction that failed). ``host`` and ``records`` are the workers' and the trainer's halves of
``workers``. Nothing here imports jax.
"""

from rft_jax.environments.base import STATUSES
from rft_jax.environments.base import Environment
from rft_jax.environments.base import EnvironmentOutputError
from rft_jax.environments.base import Message
from rft_jax.environments.base import Outcome
from rft_jax.environments.base import StepOutput
from rft_jax.environments.base import check_messages
from rft_jax.environments.base import check_step_output
from rft_jax.environments.faults import EnvironmentCounts
from rft_jax.environments.faults import EnvironmentFaultError
from rft_jax.environments.faults import check_fault_fraction
from rft_jax.environments.guess_number import GuessNumber
from rft_jax.environments.registry import EnvironmentSpec
from rft_jax.environments.registry import environment_factory
from rft_jax.environments.registry import make_environment
from rft_jax.environments.registry import register_environment
from rft_jax.environments.registry import registered_names
from rft_jax.environments.tool_use import ToolUse
from rft_jax.environments.tool_use import tool_schemas
from rft_jax.environments.workers import EnvironmentWorkers

__all__ = [
    "STATUSES",
    "Environment",
    "EnvironmentCounts",
    "EnvironmentFaultError",
    "EnvironmentOutputError",
    "EnvironmentSpec",
    "EnvironmentWorkers",
    "GuessNumber",
    "Message",
    "Outcome",
    "StepOutput",
    "ToolUse",
    "check_fault_fraction",
    "check_messages",
    "check_step_output",
    "environment_factory",
    "make_environment",
    "register_environment",
    "registered_names",
    "tool_schemas",
]
