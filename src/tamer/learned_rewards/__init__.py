"""Learned rewards, for tasks whose quality no rule can check: a trained reward model, an LLM judge.

Both are batch rewards (`tamer.rewards.BatchReward`), registered in `tamer.rewards` as
`reward_model` and `judge`; see reward_model.py and judge.py.
"""

from tamer.learned_rewards.judge import JudgeParseError, JudgeReward
from tamer.learned_rewards.reward_model import (
    RewardModelReward,
    RewardModelScorer,
    encode_texts,
    pad_right,
    preference_text,
    reward_forward,
)

__all__ = ["JudgeParseError", "JudgeReward", "RewardModelReward", "RewardModelScorer", "encode_texts",
           "pad_right", "preference_text", "reward_forward"]
