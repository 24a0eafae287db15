"""Learned rewards: the reward_model reward (batched, normalised, cached, in GRPO and PPO steps), the
LLM judge (parsing failures contained, cache per text), and the composer's batch interface."""

import dataclasses

import pytest
import torch

from tamer.config import ConfigError
from tamer.evaluate import EvalConfig
from tamer.learned_rewards import JudgeParseError, JudgeReward, RewardModelReward, RewardModelScorer, preference_text
from tamer.models import save_model
from tamer.rewards import REWARDS, BatchReward, RewardComposer, RewardConfig
from tamer.rollout.engine import HFEngine
from tamer.rollout.types import GenerationOutput, Trajectory
from tamer.tasks import ArithmeticTasks
from tamer.tasks.base import Task
from tamer.trainers.common import OptimConfig
from tamer.trainers.critic import CriticConfig
from tamer.trainers.reward_model import reward_model_from
from tamer.trainers.rl import AlgorithmConfig, RLConfig, RLTrainer


def _traj(text, prompt="47+38"):
    task = Task(id=prompt, messages=({"role": "user", "content": prompt},), answer="85")
    return Trajectory(task=task, group_id=0, prompt_ids=[1], completion_ids=[0], loss_mask=[1], logprobs=[0.0],
                      text=text)


@pytest.fixture
def rm_dir(tiny_model, tokenizer, tmp_path):
    """A reward model saved as an HF directory; a random head so that different texts score differently."""
    rm, rm_tokenizer = reward_model_from(tiny_model, tokenizer)
    with torch.no_grad():
        rm.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    return save_model(rm, rm_tokenizer, tmp_path / "rm")


class _Counting:
    """Wraps a scorer to count the texts that reached the model."""

    def __init__(self, scorer):
        self.scorer, self.texts = scorer, 0

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def score_texts(self, texts):
        self.texts += len(texts)
        return self.scorer.score_texts(texts)


def test_reward_model_reward_scores_prompt_and_completion_text(rm_dir):
    composer = RewardComposer(RewardConfig(weights={"reward_model": 2.0},
                                           params={"reward_model": {"path": str(rm_dir)}}))
    fn = composer.functions["reward_model"]
    assert isinstance(fn, RewardModelReward) and isinstance(fn, BatchReward)
    trajs = [_traj("<answer>85</answer><|im_end|>"), _traj("<answer>84</answer><|im_end|>"),
             _traj("<answer>85</answer><|im_end|>", prompt="40+45")]
    stats = composer.score(trajs)
    scorer = RewardModelScorer.load(rm_dir)
    expected = scorer.score_texts([preference_text(scorer.tokenizer, t.task.messages, t.text) for t in trajs])
    torch.testing.assert_close(torch.tensor([t.rewards["reward_model"] for t in trajs]), torch.tensor(expected))
    torch.testing.assert_close(torch.tensor([t.reward for t in trajs]), 2 * torch.tensor(expected))
    assert len(set(expected)) == 3 and stats.errors == {"reward_model": 0}
    # The rollout text already ends with its stop token: nothing is appended twice.
    assert preference_text(scorer.tokenizer, trajs[0].task.messages, trajs[0].text).endswith("</answer><|im_end|>")


def test_reward_model_batch_normalisation_and_cache(rm_dir):
    reward = RewardModelReward(str(rm_dir), normalize="batch", batch_size=2)
    reward.scorer = _Counting(reward.scorer)
    trajs = [_traj(f"<answer>{n}</answer><|im_end|>") for n in (1, 2, 3, 1)]
    scores = torch.tensor(reward.score_batch(trajs), dtype=torch.float64)
    torch.testing.assert_close(scores.mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(scores.std(), torch.tensor(1.0, dtype=torch.float64), atol=1e-4, rtol=0)
    assert scores[0] == scores[3] and reward.scorer.texts == 3  # the repeated text was scored once
    reward.score_batch(trajs[:2])
    assert reward.scorer.texts == 3  # all cached


def test_reward_model_params_are_checked_before_work(tmp_path):
    with pytest.raises(ConfigError, match="reward.params.reward_model: path"):
        RewardComposer(RewardConfig(weights={"reward_model": 1.0}))
    with pytest.raises(ConfigError, match="reward.params.reward_model: normalize"):
        RewardComposer(RewardConfig(weights={"reward_model": 1.0},
                                    params={"reward_model": {"path": "x", "normalize": "zscore"}}))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        RewardComposer(RewardConfig(weights={"reward_model": 1.0}, params={"reward_model": {"path": str(tmp_path)}}))


def test_failing_batch_reward_is_contained(rm_dir):
    reward = RewardModelReward(str(rm_dir))

    def broken(texts):
        raise RuntimeError("out of memory")

    reward.scorer.score_texts = broken
    REWARDS.register("broken_rm")(reward)  # a batch reward registered already built
    composer = RewardComposer(RewardConfig(weights={"broken_rm": 1.0, "format": 1.0}, default_on_error=-1.0))
    trajs = [_traj("<answer>85</answer>"), _traj("x")]
    stats = composer.score(trajs)
    assert [t.rewards["broken_rm"] for t in trajs] == [-1.0, -1.0]
    assert [t.rewards["format"] for t in trajs] == [1.0, 0.0]  # the other reward still ran
    assert stats.errors == {"broken_rm": 2, "format": 0} and "out of memory" in stats.first_traceback


def _rl(model, tokenizer, tmp_path, rm_dir, **overrides):
    cfg = RLConfig(**{"steps": 2, "prompts_per_step": 3, "group_size": 4, "max_new_tokens": 8,
                      "optim": OptimConfig(lr=1e-3), "eval_every": 0, **overrides})
    train, held = ArithmeticTasks().split()
    rewards = RewardComposer(RewardConfig(weights={"reward_model": 1.0},
                                          params={"reward_model": {"path": str(rm_dir), "normalize": "batch"}}))
    return RLTrainer(model, tokenizer, train, held, rewards, cfg, EvalConfig(size=4, max_new_tokens=8),
                     run_dir=tmp_path)


def test_reward_model_reward_in_a_grpo_step(tiny_model, tokenizer, tmp_path, rm_dir):
    before = [p.detach().clone() for p in tiny_model.parameters()]
    trainer = _rl(tiny_model, tokenizer, tmp_path, rm_dir)
    metrics = trainer.train_step()
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert metrics["reward/errors_total"] == 0.0
    assert abs(metrics["reward/reward_model"]) < 1e-5  # batch-normalised: mean 0 over the step's rollouts
    assert metrics["reward/std"] > 0.5  # ... and spread, so GRPO has a signal
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))


def test_reward_model_reward_in_rlhf_ppo(tiny_model, tokenizer, tmp_path, rm_dir):
    """Classic RLHF-PPO: the RM score on the last token, −β·KL on every token, a critic."""
    trainer = _rl(tiny_model, tokenizer, tmp_path, rm_dir, algorithm=AlgorithmConfig(advantage="gae"),
                  critic=CriticConfig(kl_in_reward=0.05, shared=True))
    assert trainer.ref_model is not None
    metrics = trainer.train_step()
    assert torch.isfinite(torch.tensor(metrics["train/loss"])) and "critic/value_loss" in metrics


# ---------------------------------------------------------------------------- the judge
class _ScriptedEngine:
    """A GenerationEngine that answers each judge prompt from a script (by a word in the reply)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.prompts = tokenizer, script, 0

    def generate(self, prompts, params):
        self.prompts += len(prompts)
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            answer = next(a for key, a in self.script.items() if key in text)
            out.append([GenerationOutput(self.tokenizer(answer)["input_ids"], [0.0], "stop")])
        return out

    def sync_weights(self, model):
        pass


def test_judge_scores_parses_and_contains_failures(tokenizer):
    engine = _ScriptedEngine(tokenizer, {"GOOD": "Score: 7", "ODD": "I like it!", "LOUD": "Score: 11"})
    judge = JudgeReward(engine=engine, tokenizer=tokenizer)
    REWARDS.register("scripted_judge")(judge)
    composer = RewardComposer(RewardConfig(weights={"scripted_judge": 1.0}, default_on_error=0.25))
    trajs = [_traj("GOOD<|im_end|>"), _traj("ODD"), _traj("LOUD"), _traj("GOOD<|im_end|>")]
    stats = composer.score(trajs)
    values = [t.rewards["scripted_judge"] for t in trajs]
    assert values[0] == values[3] == pytest.approx(6 / 9)  # (7 − 1) / (10 − 1)
    assert values[1] == values[2] == 0.25  # unparsable and out of range: the default score
    assert stats.errors == {"scripted_judge": 2} and "JudgeParseError: no score" in stats.first_traceback
    assert engine.prompts == 3  # the repeated reply was judged once
    composer.score([_traj("ODD"), _traj("GOOD<|im_end|>")])
    assert engine.prompts == 3 and composer.total_errors == 3  # cached failures still count as errors
    # The judge reads the reply without the policy's stop token, and the task's prompt.
    assert "Reply:\nGOOD\n" in judge.prompt(trajs[0]) and "Request:\n47+38" in judge.prompt(trajs[0])


def test_judge_parse_rules(tokenizer):
    judge = JudgeReward(engine=_ScriptedEngine(tokenizer, {}), tokenizer=tokenizer, min_score=0, max_score=5)
    assert judge.parse("Score: 5") == 1.0 and judge.parse("so... Score:0") == 0.0
    for bad in ("Score: 6", "score 3", ""):
        with pytest.raises(JudgeParseError):
            judge.parse(bad)
    with pytest.raises(ValueError, match="rubric"):
        JudgeReward(engine=judge.engine, tokenizer=tokenizer, rubric="no slots")
    with pytest.raises(ValueError, match="rubric"):
        JudgeReward(engine=judge.engine, tokenizer=tokenizer, rubric="{prompt} {reply} {other}")


def test_local_hf_judge_from_config(tiny_model, tokenizer, tmp_path):
    """An untrained local model as judge: it writes no score, every rollout is an error, the run goes on."""
    path = save_model(tiny_model, tokenizer, tmp_path / "judge")
    composer = RewardComposer(RewardConfig(weights={"judge": 1.0, "correctness": 1.0},
                                           params={"judge": {"path": str(path), "max_new_tokens": 4}}))
    assert isinstance(composer.functions["judge"].engine, HFEngine)
    trajs = [_traj("<answer>85</answer>"), _traj("<answer>1</answer>")]
    stats = composer.score(trajs)
    assert stats.errors["judge"] == 2 and [t.reward for t in trajs] == [1.0, 0.0]


# ---------------------------------------------------------------------------- advise: agreement with preferences
def _pairs_file(path, n=20):
    import json

    rows = [{"prompt": f"{a} kg + {a} kg", "chosen": f"<answer>{2 * a} kg</answer>",
             "rejected": f"<answer>{2 * a}</answer>"}
            for a in range(1, n + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_learned_reward_checks_measure_agreement_and_flag_a_useless_reward_model(tiny_model, tokenizer, tmp_path):
    from tamer.advise import Measurements, RewardHealth, StepCost, decide
    from tamer.config import load_config
    from tamer.learned_rewards.agreement import AGREEMENT_MIN, learned_reward_checks
    from tamer.pipeline import RunConfig

    def _measurements(**changes):
        base = dict(task="t", model="m", parameters=10, train_tasks=1000, heldout_tasks=100, eval_tasks=32,
                    samples_per_task=8, k=8, greedy_accuracy=0.3, pass_at_1=0.3, pass_at_k=0.8, spread_prompts=16,
                    group_size=8, zero_spread_fraction=0.2, reward_mean=0.3,
                    rewards=[RewardHealth("reward_model", 1.0, 128, 0, [0.1, 0.7], [0.2, 0.9], False)],
                    steps={"grpo": StepCost("grpo", 1.0, 1000.0, 300.0, 1, 10)})
        return Measurements(**{**base, **changes})

    rm, rm_tokenizer = reward_model_from(tiny_model, tokenizer)  # zero head: every pair is a tie
    flat = save_model(rm, rm_tokenizer, tmp_path / "flat")
    pairs = _pairs_file(tmp_path / "prefs.jsonl")
    sets = [f"rm.data.path={pairs}", "rm.data.heldout_fraction=0.5", "reward.weights={reward_model: 1.0, format: 0.1}"]
    cfg = load_config(RunConfig, None, sets + [f"reward.params={{reward_model: {{path: {flat}}}}}"])
    [check] = learned_reward_checks(cfg, eos_token="<|im_end|>")
    assert (check.name, check.pairs, check.errors) == ("reward_model", 10, 0)
    assert check.accuracy == 0.0 and check.ties == 1.0 and check.too_low and check.ece is not None
    advice = decide(_measurements(learned_rewards=[check]))
    assert advice.verdict == "fix_reward" and "reward_model agrees with only 0.0% of 10" in advice.headline
    assert "preferences     reward_model: agrees with 0.0%" in advice.text()
    good = dataclasses.replace(check, accuracy=AGREEMENT_MIN + 0.1, ties=0.0, too_low=False)
    assert decide(_measurements(learned_rewards=[good])).verdict == "grpo"
    no_data = load_config(RunConfig, None, [sets[2], f"reward.params={{reward_model: {{path: {flat}}}}}"])
    [missing] = learned_reward_checks(no_data)
    assert not missing.too_low and "set rm.data.path" in missing.line()


def test_agreement_of_a_judge_counts_its_failures(tokenizer):
    from tamer.learned_rewards.agreement import preference_agreement
    from tamer.tasks.preferences import PreferencePair

    engine = _ScriptedEngine(tokenizer, {"12 kg": "Score: 9", "12<": "Score: 3", "13": "no idea"})
    judge = JudgeReward(engine=engine, tokenizer=tokenizer)
    msgs = ({"role": "user", "content": "5 kg + 7 kg"},)
    pairs = [PreferencePair(msgs, "<answer>12 kg</answer>", "<answer>12</answer>"),
             PreferencePair(msgs, "<answer>12 kg</answer>", "<answer>13</answer>")]
    result = preference_agreement(judge, pairs, "judge", eos_token="<|im_end|>")
    assert (result.pairs, result.errors, result.accuracy, result.ece) == (1, 1, 1.0, None)
