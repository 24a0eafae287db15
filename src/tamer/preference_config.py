"""The preference demo's own settings (`tamer demo --env preference`; the `preference` section of a run).

Kept apart from `tamer.preference_demo` (which runs the demo on the pipeline's jobs) so that the
run config can hold it without importing the demo.
"""

from __future__ import annotations

from dataclasses import dataclass

from tamer.config import FieldError, check_name

VARIANTS = ("grpo", "grpo_kl", "ppo")


@dataclass(frozen=True)
class PreferenceDemoConfig:
    """The demo's own settings: preference data size, which RL runs, their KL strengths."""

    train_pairs: int = 2000  # labelled pairs on training prompts (reward-model training set)
    heldout_pairs: int = 300  # pairs on held-out prompts (reward-model accuracy and calibration)
    variants: tuple[str, ...] = VARIANTS  # grpo (β = 0) | grpo_kl (β = kl_coef) | ppo (critic, KL in the reward)
    kl_coef: float = 0.1  # β of grpo_kl: k3 KL to the SFT model in the loss
    ppo_kl_in_reward: float = 0.1  # β of ppo: −β·k1 per token in the reward (classic RLHF-PPO)
    kl_samples: int = 100  # held-out prompts sampled (T = rl.temperature) for the KL estimate

    def __post_init__(self) -> None:
        for name in self.variants:
            check_name("variants", name, VARIANTS, "variant")
        for name in ("train_pairs", "heldout_pairs", "kl_samples"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        for name in ("kl_coef", "ppo_kl_in_reward"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"expected >= 0, got {getattr(self, name)}")
