"""The algorithm core: advantage estimators, policy/value losses, KL estimators.

Pure functions over tensors, chosen by name from registries; no I/O, no logging, no
config objects. See advantages.py, losses.py and kl.py, and /work/shared/MATH.md.
"""

from tamer.algorithms.advantages import (
    ADVANTAGES,
    dr_grpo,
    gae,
    get_advantage_fn,
    grpo,
    reinforce_pp,
    rloo,
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

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "aggregate",
    "dr_grpo",
    "gae",
    "get_advantage_fn",
    "get_policy_loss_fn",
    "grpo",
    "gspo",
    "kl_penalty",
    "masked_mean",
    "ppo",
    "reinforce_pp",
    "rloo",
    "value_loss",
    "zero_spread_groups",
]
