"""Before training against a learned reward: does it agree with held-out preferences?

A reward model or judge is only a proxy for what the labellers meant; RL will push the policy
wherever the proxy is wrong. This measures, for every learned (batch) reward in
`reward.weights`, the fraction of held-out preference pairs whose chosen reply it scores
strictly above the rejected one, and, for a Bradley–Terry reward model (whose score gaps are
logits), the calibration of σ(gap). Below `AGREEMENT_MIN` it is too weak to train against.

    checks = learned_reward_checks(config, eos_token="<|im_end|>")   # `tamer advise` calls this
    [c.line() for c in checks]; [c.problem() for c in checks if c.too_low]

Held-out pairs come from the run's `rm.data` section (its held-out file or split, else the
held-out fraction of its rows): the same pairs `tamer rm` reports its accuracy on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tamer.algorithms.preference import calibration
from tamer.rollout.types import Trajectory
from tamer.tasks.base import Task
from tamer.tasks.preferences import PreferencePair, load_preference_pairs

AGREEMENT_MIN = 0.65  # held-out pairwise agreement below which a learned reward is not worth training against


@dataclass
class PreferenceAgreement:
    """One learned reward against held-out preference pairs."""

    name: str
    pairs: int  # pairs scored (both replies without error)
    accuracy: float  # chosen scored strictly above rejected; NaN when not measured
    ties: float  # fraction scored equal (counted as disagreement)
    errors: int  # pairs left out because the reward failed on one of the replies
    ece: float | None  # calibration error of σ(r_c − r_r); None unless the reward is a Bradley–Terry model
    too_low: bool
    note: str = ""  # why it was not measured

    def line(self) -> str:
        if self.note:
            return f"{self.name}: not measured ({self.note})"
        ece = f", ECE {self.ece:.3f}" if self.ece is not None else ""
        return (f"{self.name}: agrees with {self.accuracy:.1%} of {self.pairs} held-out preference pairs "
                f"(ties {self.ties:.1%}{ece}; {self.errors} pairs failed)")

    def problem(self) -> str:
        return (f"{self.name} agrees with only {self.accuracy:.1%} of {self.pairs} held-out preferences "
                f"(< {AGREEMENT_MIN:.0%}): RL would optimise its errors; train it on more or cleaner pairs")


def _probe(pair: PreferencePair, reply: str, eos_token: str, index: int) -> Trajectory:
    """A finished rollout whose completion is `reply`, as the reward would see it after RL sampling."""
    task = Task(id=pair.source or str(index), messages=pair.messages, answer="")
    return Trajectory(task=task, group_id=index, prompt_ids=[], completion_ids=[], loss_mask=[], logprobs=[],
                      text=reply + eos_token, finish_reason="stop")


def preference_agreement(reward, pairs: list[PreferencePair], name: str = "reward", eos_token: str = "",
                         bradley_terry: bool = False, bins: int = 10) -> PreferenceAgreement:
    """Score each pair's chosen and rejected reply with `reward.score_batch`; agreement, ties, calibration."""
    trajs = [_probe(p, p.chosen, eos_token, i) for i, p in enumerate(pairs)]
    trajs += [_probe(p, p.rejected, eos_token, i) for i, p in enumerate(pairs)]
    values = list(reward.score_batch(trajs))
    ok = [i for i in range(len(pairs)) if not any(isinstance(v, Exception) or math.isnan(float(v))
                                                   for v in (values[i], values[len(pairs) + i]))]
    if not ok:
        return PreferenceAgreement(name, 0, float("nan"), 0.0, len(pairs), None, True, "it failed on every pair")
    gaps = torch.tensor([float(values[i]) - float(values[len(pairs) + i]) for i in ok], dtype=torch.float64)
    accuracy = float((gaps > 0).double().mean())
    ece = calibration(gaps.float(), bins).ece if bradley_terry else None
    return PreferenceAgreement(name, len(ok), accuracy, float((gaps == 0).double().mean()), len(pairs) - len(ok),
                               ece, accuracy < AGREEMENT_MIN)


def learned_reward_checks(config, eos_token: str = "") -> list[PreferenceAgreement]:
    """`preference_agreement` for every batch reward in `config.reward.weights`, on `config.rm.data`'s
    held-out pairs."""
    from tamer.learned_rewards.reward_model import RewardModelReward
    from tamer.rewards import REWARDS, BatchReward, RewardComposer, RewardConfig

    names = [n for n in config.reward.weights if n in REWARDS and isinstance(REWARDS.get(n), type)
             and issubclass(REWARDS.get(n), BatchReward)]
    if not names:
        return []
    data = config.rm.data
    if not (data.path or data.hf_dataset):
        note = "no preference pairs to check against: set rm.data.path (and rm.data.heldout_path)"
        return [PreferenceAgreement(n, 0, float("nan"), 0.0, 0, None, False, note) for n in names]
    _, heldout = load_preference_pairs(data)
    checks = []
    for name in names:
        params = {name: config.reward.params[name]} if name in config.reward.params else {}
        reward = RewardComposer(RewardConfig(weights={name: 1.0}, params=params)).functions[name]
        checks.append(preference_agreement(reward, heldout, name, eos_token,
                                           bradley_terry=isinstance(reward, RewardModelReward)))
    return checks
