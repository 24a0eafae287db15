"""Multi-turn rollouts: the agent generates, the environment answers, until done.

    rollout = AgentRollout(engine, tokenizer, AgentConfig(max_turns=8))
    trajectories = rollout.run(tasks, params)      # params.n attempts per task

Token-in, token-out: each turn's sampled tokens are appended exactly as sampled
(`loss_mask = 1`, with their sampling logprobs); the environment's reply is rendered
through the tokenizer's chat template as tool message(s) and appended as tokens with
`loss_mask = 0`. Nothing is ever re-tokenized, so the learner trains on exactly the
tokens that were sampled. Generation is batched across every live trajectory of every
task at each turn; the first turn samples all `n` attempts from one shared prompt prefix, and
later turns prefill only what is new since the last turn (`SamplingParams.reuse_prefix`).
With `env_threads > 1` the environment steps of one turn's episodes run concurrently in a
thread pool (tools that wait on I/O, sandboxes, APIs); tokens and order are the same.

Single-turn tasks (no environment) do not come here: `Rollout` samples them in one `generate` call.

Tool calls follow the model family's format (`AgentConfig.tool_format`, detected from the
chat template when empty; see `tamer.tools.formats`): tool environments parse turns and
answer in it, and scripted demonstrations (written with Hermes `<tool_call>` blocks) are
rewritten into it by `replay`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from tamer.config import FieldError, check_name
from tamer.models import encode_chat
from tamer.rollout.engine import GenerationEngine
from tamer.rollout.isolation import IsolatedEnvironment
from tamer.rollout.types import GenerationOutput, SamplingParams, Trajectory, Turn, trajectory_seed
from tamer.tasks.base import Task
from tamer.tasks.env import ENVIRONMENTS, Environment, StepResult
from tamer.tools.formats import TOOL_FORMATS, Observation, resolve_format, turn_decoder


@dataclass(frozen=True)
class AgentConfig:
    """Budgets of one multi-turn episode."""

    max_turns: int = 8  # assistant turns per episode
    max_total_tokens: int = 1024  # generated + environment tokens after the prompt
    show_tools: bool = True  # render tool schemas into the prompt (chat template `tools=`)
    tool_format: str = ""  # a name in tamer.tools.formats.TOOL_FORMATS; "" detects it from the chat template
    tool_isolation: str = "thread"  # thread | process: each episode's environment in a killable worker
    env_threads: int = 1  # episodes whose environment steps run at once (threads); 1: one after another

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "env_threads"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"expected >= 1, got {getattr(self, name)}")
        if self.tool_format:
            check_name("tool_format", self.tool_format, TOOL_FORMATS.names(), "tool-call format")
        check_name("tool_isolation", self.tool_isolation, ("thread", "process"), "tool isolation")


def default_env_factory(task: Task) -> Environment:
    return ENVIRONMENTS.get(task.env)()


class ToolMessageRenderer:
    """Token ids that follow an assistant turn: the tool message(s) and the next assistant header.

    Rendered through the chat template as the difference between a conversation with and
    without the tool messages, so any template (ChatML, Qwen, Llama, Mistral) gets its own
    format. An observation is one string (one tool message) or a list of message dicts
    (`tamer.tools.formats`: one per call, with `tool_call_id` where the format needs it).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token
        self.base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        plain = tokenizer.apply_chat_template(self.base, tokenize=False)
        end = plain.rfind(eos) + len(eos) if eos and eos in plain else len(plain)
        self.head = plain[:end]  # everything up to the end of the assistant turn
        self._pieces: dict[tuple, list[str] | None] = {}
        self.text("obs")  # fails here, not mid-rollout, for a template that cannot render it

    def text(self, observation: Observation) -> str:
        messages = [{"role": "tool", "content": observation}] if isinstance(observation, str) else list(observation)
        contents = [m["content"] for m in messages]
        # Templates that insert the content verbatim render once per message layout and are
        # filled in by string joins (~10x faster than rendering); others render every time.
        pieces = self._layout(messages) if all(c and c == c.strip() for c in contents) else None
        if pieces is None:
            return self._render(messages)
        return "".join(p + c for p, c in zip(pieces, contents)) + pieces[-1]

    def _layout(self, messages: list[dict]) -> list[str] | None:
        """The rendered text around each message's content (None if a template transforms content)."""
        key = tuple(tuple(sorted((k, v) for k, v in m.items() if k != "content")) for m in messages)
        if key not in self._pieces:
            if len(self._pieces) > 1024:
                self._pieces.clear()
            markers = [f"\x00OBS{i}\x00" for i in range(len(messages))]
            text = self._render([{**m, "content": mk} for m, mk in zip(messages, markers)])
            pieces = []
            for marker in markers:
                before, found, text = text.partition(marker)
                if not found or marker in text:
                    pieces = None
                    break
                pieces.append(before)
            self._pieces[key] = None if pieces is None else pieces + [text]
        return self._pieces[key]

    def _render(self, messages: list[dict]) -> str:
        full = self.tokenizer.apply_chat_template(self.base + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.head):
            raise ValueError("chat template renders earlier turns differently once a tool message follows")
        return full[len(self.head):]

    def __call__(self, observation: Observation) -> list[int]:
        return self.tokenizer(self.text(observation), add_special_tokens=False)["input_ids"]


@dataclass
class _Episode:
    task: Task
    env: Environment
    group_id: int
    prompt_ids: list[int]
    sample: int = 0  # index within the group (per-trajectory seeds)
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    finish_reason: str = "stop"
    done: bool = False
    weight_version: int | None = None


class AgentRollout:
    """Runs environment tasks as multi-turn episodes through a generation engine."""

    def __init__(self, engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase,
                 config: AgentConfig = AgentConfig(),
                 env_factory: Callable[[Task], Environment] = default_env_factory, seeding: str = "batch") -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.env_factory = env_factory
        self.seeding = seeding  # "trajectory": each episode samples from its own stream (tamer.rollout.runner)
        self.render_tool = ToolMessageRenderer(tokenizer)
        self.stop_eos = tokenizer.eos_token_id
        self.tool_format = resolve_format(config.tool_format, tokenizer)
        self.decode_turn = turn_decoder(tokenizer, self.tool_format)

    def run(self, tasks: list[Task], params: SamplingParams, group_offset: int = 0) -> list[Trajectory]:
        episodes = [self._start(task, group_offset + j, k) for j, task in enumerate(tasks) for k in range(params.n)]
        for turn in range(self.config.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            self._play_turn(live, params, turn)
        return [self._finish(e) for e in episodes]

    def replay(self, task: Task, turns: list[str]) -> Trajectory:
        """A scripted episode: `turns` (assistant texts) played against a fresh environment.

        Produces exactly the token layout a sampled episode has, so SFT demonstrations and
        RL rollouts share one format. Turns written with Hermes `<tool_call>` blocks are
        rewritten into the rollout's tool format first (`ToolFormat.convert`).
        """
        episode = self._start(task, group_id=0)
        for text in turns:
            if episode.done:
                break
            text = self.tool_format.convert(text)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop_eos]
            self._apply(episode, GenerationOutput(ids, [0.0] * len(ids), "stop"))
        return self._finish(episode)

    def _start(self, task: Task, group_id: int, sample: int = 0) -> _Episode:
        env = self.env_factory(task)
        if hasattr(env, "use_tool_format"):  # tool environments parse and answer in the model's format
            env.use_tool_format(self.tool_format)
        if self.config.tool_isolation == "process":
            env = IsolatedEnvironment(env)
        first = env.reset(task)
        messages = [dict(m) for m in task.messages]
        if first:
            messages[-1]["content"] += "\n" + first
        tools = getattr(env, "tools", None) if self.config.show_tools else None
        return _Episode(task, env, group_id, encode_chat(self.tokenizer, messages, tools=tools or None), sample)

    def _play_turn(self, live: list[_Episode], params: SamplingParams, turn: int) -> None:
        budget = max(1, min(params.max_new_tokens,
                            min(self.config.max_total_tokens - len(e.completion_ids) for e in live)))
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=budget, seed=params.seed + 7919 * turn,
                                          reuse_prefix=True)  # the next turn extends this one
        if self.seeding == "trajectory":
            seeds = tuple(trajectory_seed(turn_params.seed, e.group_id, e.sample) for e in live)
            turn_params = dataclasses.replace(turn_params, row_seeds=seeds)
        if turn == 0:  # all attempts share the prompt: sample n per distinct task from one prefix
            heads = live[:: params.n]
            outputs = [o for group in self.engine.generate([e.prompt_ids for e in heads],
                                                           dataclasses.replace(turn_params, n=params.n)) for o in group]
        else:
            outputs = [g[0] for g in self.engine.generate([e.prompt_ids + e.completion_ids for e in live], turn_params)]
        texts = [self.decode_turn(out.token_ids) for out in outputs]
        if self.config.env_threads > 1 and len(live) > 1:  # environments wait on tools: step them together
            with ThreadPoolExecutor(min(self.config.env_threads, len(live)), thread_name_prefix="env") as pool:
                results = list(pool.map(self._timed_step, [e.env for e in live], texts))
        else:
            results = [self._timed_step(e.env, text) for e, text in zip(live, texts)]
        for episode, out, result in zip(live, outputs, results):
            self._apply(episode, out, *result)

    def _timed_step(self, env: Environment, text: str) -> tuple[StepResult, float]:
        start = time.perf_counter()
        result = self._step(env, text)
        return result, time.perf_counter() - start

    def _apply(self, episode: _Episode, out, result: StepResult | None = None, seconds: float = 0.0) -> None:
        """Append a turn's sampled tokens, the environment's answer to them (stepped here unless
        `result` is given) and the tool message's tokens."""
        if result is None:
            result, seconds = self._timed_step(episode.env, self.decode_turn(out.token_ids))
        episode.completion_ids += out.token_ids
        episode.loss_mask += [1] * len(out.token_ids)
        episode.logprobs += list(out.logprobs)
        version = getattr(out, "weight_version", None)
        if version is not None:  # the oldest weights any turn was sampled with
            episode.weight_version = version if episode.weight_version is None else min(episode.weight_version, version)
        record = Turn(generated=len(out.token_ids), env_reward=result.reward, seconds=seconds)
        for call in result.info.get("turn_calls", []):
            record.tool_calls.append({"name": call.get("name"), "arguments": call.get("arguments")})
            if not call.get("ok", True):
                record.errors.append(call.get("error_kind") or "error")
        if isinstance(result.observation, str):
            record.tool_results.append(result.observation)
        elif result.observation is not None:  # one message per call
            record.tool_results.extend(m["content"] for m in result.observation)
        episode.turns.append(record)
        episode.info.update({k: v for k, v in result.info.items() if k != "turn_calls"})
        if result.done:
            episode.done = True
            return
        obs_ids = self.render_tool(result.observation if result.observation is not None else "")
        if out.finish_reason == "length":  # close the cut-off turn so the template stays well-formed
            obs_ids = [self.stop_eos] + obs_ids
        if len(episode.completion_ids) + len(obs_ids) >= self.config.max_total_tokens or \
                len(episode.turns) >= self.config.max_turns:
            episode.done, episode.finish_reason = True, "length"
            return
        episode.completion_ids += obs_ids
        episode.loss_mask += [0] * len(obs_ids)
        episode.logprobs += [0.0] * len(obs_ids)

    @staticmethod
    def _step(env: Environment, text: str) -> StepResult:
        try:
            return env.step(text)
        except Exception as err:
            return StepResult(None, done=True, info={"env_error": f"{type(err).__name__}: {err}", "success": False})

    def _finish(self, e: _Episode) -> Trajectory:
        return Trajectory(task=e.task, group_id=e.group_id, prompt_ids=e.prompt_ids, completion_ids=e.completion_ids,
                          loss_mask=e.loss_mask, logprobs=e.logprobs,
                          text=self.tokenizer.decode(e.completion_ids, skip_special_tokens=False),
                          finish_reason=e.finish_reason, turns=e.turns, info=e.info, weight_version=e.weight_version)
