"""LLM-as-judge: a local model reads each rollout with a rubric and writes a score.

The judge is a causal LM behind the same `GenerationEngine` the rollouts use (the HF engine
by default; any engine with that `generate` call, e.g. a vLLM one, can be passed in). For
each rollout it is asked, greedily, the rubric filled with the task's prompt and the reply;
the first match of `score_pattern` in its answer is the score, mapped from
[min_score, max_score] to [0, 1]. An answer with no score, or one out of range, is a parsing
failure: it counts as that trajectory's reward error and gets `reward.default_on_error`.
Verdicts (failures included) are cached per (prompt, reply) text, so a reply the policy
samples again costs nothing.

    reward:
      weights: {judge: 1.0}
      params: {judge: {path: path/to/local/instruct-model, max_new_tokens: 16}}

From Python, with an engine of your own: `JudgeReward(engine=engine, tokenizer=tokenizer)`.
"""

from __future__ import annotations

import re
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tamer.learned_rewards.reward_model import DTYPES, LRUCache
from tamer.models import encode_chat, load_model, stop_token_ids
from tamer.rollout.engine import GenerationEngine, HFEngine
from tamer.rollout.types import SamplingParams, Trajectory

DEFAULT_RUBRIC = (
    "Rate the reply to the request below from {min_score} (useless) to {max_score} (perfect): "
    "is it correct, complete and concise?\n\n"
    "Request:\n{prompt}\n\nReply:\n{reply}\n\n"
    "Answer with one line: Score: N"
)
DEFAULT_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"


class JudgeParseError(ValueError):
    """The judge's answer held no score in range; the message quotes it."""


class JudgeReward:
    """The `judge` reward function (a batch reward: one generate call per scoring pass)."""

    def __init__(self, path: str = "", *, rubric: str = DEFAULT_RUBRIC, score_pattern: str = DEFAULT_PATTERN,
                 min_score: float = 1.0, max_score: float = 10.0, max_new_tokens: int = 16,
                 device: str = "cpu", dtype: str = "float32", cache_size: int = 100_000,
                 engine: GenerationEngine | None = None, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        if max_score <= min_score:
            raise ValueError(f"max_score ({max_score}) must be above min_score ({min_score})")
        for key in ("{prompt}", "{reply}"):
            if key not in rubric:
                raise ValueError(f"rubric: must contain {key}")
        try:
            rubric.format(prompt="", reply="", min_score="", max_score="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"rubric: only {{prompt}}, {{reply}}, {{min_score}}, {{max_score}} may be "
                             f"in braces (double other braces): {err!r}") from None
        self.pattern = re.compile(score_pattern)
        if self.pattern.groups < 1:
            raise ValueError("score_pattern: needs one group that captures the number")
        if engine is None:
            engine, tokenizer = self._hf_engine(path, device, dtype)
        elif tokenizer is None:
            raise ValueError("tokenizer: a judge engine passed in needs its tokenizer too")
        self.engine, self.tokenizer = engine, tokenizer
        self.rubric, self.min_score, self.max_score = rubric, min_score, max_score
        self.params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                                     stop_token_ids=stop_token_ids(tokenizer))
        self._cache: LRUCache[float | JudgeParseError] = LRUCache(cache_size)

    @staticmethod
    def _hf_engine(path: str, device: str, dtype: str) -> tuple[HFEngine, PreTrainedTokenizerBase]:
        if not path:
            raise ValueError("path: give the directory of a local judge model")
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        model, tokenizer = load_model(Path(path), dtype=DTYPES[dtype], device=device)
        for p in model.parameters():
            p.requires_grad_(False)
        return HFEngine(model.eval(), tokenizer.pad_token_id), tokenizer

    def prompt(self, traj: Trajectory) -> str:
        request = "\n".join(m["content"] for m in traj.task.messages if m["role"] != "system")
        return self.rubric.format(prompt=request, reply=self.reply(traj), min_score=_num(self.min_score),
                                  max_score=_num(self.max_score))

    @staticmethod
    def reply(traj: Trajectory) -> str:
        # The policy's stop token is no part of what the judge should read.
        text = traj.text
        for token in ("<|im_end|>", "<|endoftext|>", "</s>"):
            text = text.removesuffix(token)
        return text

    def parse(self, answer: str) -> float:
        """The judge's answer as a reward in [0, 1]; JudgeParseError when it holds no score in range."""
        match = self.pattern.search(answer)
        if match is None:
            raise JudgeParseError(f"no score in the judge's answer {answer[:200]!r}")
        try:
            value = float(match.group(1))
        except ValueError:
            raise JudgeParseError(f"score {match.group(1)!r} is not a number") from None
        if not self.min_score <= value <= self.max_score:
            raise JudgeParseError(f"score {value:g} outside [{_num(self.min_score)}, {_num(self.max_score)}]")
        return (value - self.min_score) / (self.max_score - self.min_score)

    def _encode(self, text: str) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            return encode_chat(self.tokenizer, ({"role": "user", "content": text},))
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def score_batch(self, trajectories: list[Trajectory]) -> list[float | Exception]:
        keys = [self.prompt(t) for t in trajectories]  # the rubric filled in: prompt and reply
        missing = list(dict.fromkeys(k for k in keys if k not in self._cache))
        fresh: dict[str, float | JudgeParseError] = {}
        if missing:
            outputs = self.engine.generate([self._encode(k) for k in missing], self.params)
            for key, samples in zip(missing, outputs):
                answer = self.tokenizer.decode(samples[0].token_ids, skip_special_tokens=True)
                try:
                    fresh[key] = self.parse(answer)
                except JudgeParseError as err:
                    fresh[key] = err
        out = [fresh[k] if k in fresh else self._cache.get(k) for k in keys]
        self._cache.update(fresh)
        return out


def _num(x: float) -> str:
    return f"{x:g}"
