"""The algorithm core: advantage estimators, policy/value losses, KL estimators.

Pure functions over tensors, chosen by name from registries; no I/O, no logging, no config
objects. Hyperparameters are keyword-only arguments; `bind` fixes them once from the config
fields of the same names. Formulas, sources and where tamer departs: docs/algorithms.md.
"""

from tamer.algorithms.advantages import (
    ADVANTAGES,
    PER_TURN,
    critic_advantages,
    dr_grpo,
    gae,
    get_advantage_fn,
    grpo,
    outcome_token_rewards,
    reinforce_pp,
    rloo,
    turn_grpo,
    whiten,
    zero_spread_groups,
)
from tamer.algorithms.kl import KL_ESTIMATORS, kl_penalty
from tamer.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    get_policy_loss_fn,
    gspo,
    masked_mean,
    ppo,
    value_loss,
)
from tamer.algorithms.offpolicy import BEHAVIOUR_WEIGHTS, behaviour_weights
from tamer.registry import bind

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "BEHAVIOUR_WEIGHTS",
    "KL_ESTIMATORS",
    "PER_TURN",
    "POLICY_LOSSES",
    "aggregate",
    "behaviour_weights",
    "bind",
    "critic_advantages",
    "dr_grpo",
    "gae",
    "get_advantage_fn",
    "get_policy_loss_fn",
    "grpo",
    "gspo",
    "kl_penalty",
    "masked_mean",
    "outcome_token_rewards",
    "ppo",
    "reinforce_pp",
    "rloo",
    "turn_grpo",
    "value_loss",
    "whiten",
    "zero_spread_groups",
]
