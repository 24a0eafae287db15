"""Tool-call formats (tools/formats.py) through each family's chat template and the real rollout loop."""

from __future__ import annotations

import random

import pytest
import torch

from tamer.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, token_logprobs
from tamer.models.chat_templates import build_family_tokenizer
from tamer.rollout.agent import AgentConfig, AgentRollout, ToolMessageRenderer
from tamer.rollout.engine import HFEngine
from tamer.rollout.types import GenerationOutput, SamplingParams
from tamer.tasks import CalculatorTasks
from tamer.tasks.base import Task
from tamer.tasks.env import ENVIRONMENTS, StepResult
from tamer.tasks.tool_env import ToolEnvironment
from tamer.tools.formats import TOOL_FORMATS, detect_format, make_format, resolve_format, turn_decoder
from tamer.tools.parsing import ToolCall
from tamer.tools.schema import ToolSet
from tamer.trainers.batch import collate

# family of the locally built tokenizer -> the format its chat template renders
FAMILIES = {"qwen2.5": "hermes", "llama3": "llama3_json", "mistral": "mistral", "json": "json"}
ADD_1_2 = ToolCall("add", {"a": 1, "b": 2}, id="c1a2b3d4e")
ADD_3_4 = ToolCall("add", {"a": 3, "b": 4}, id="f5a6b7c8d")
# One unreadable call per format: cut-off JSON in the format's own wrapping.
MALFORMED = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1',
    "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}',
    "json": '{"name": "add", "arguments": {"a": 1',
}


class _Adder(ToolEnvironment):
    def build_tools(self):
        return ToolSet([self.add])

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        return a + b


ENVIRONMENTS.register("test_adder")(_Adder)
TASK = Task(id="add", messages=({"role": "user", "content": "What is 1+2?"},), answer="3", env="test_adder")


class _Scripted:
    """An engine that 'samples' the given assistant texts, as token ids ending with EOS."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.sampled = tokenizer, list(turns), []

    def generate(self, prompts, params):
        ids = self.tokenizer(self.turns[len(self.sampled)], add_special_tokens=False)["input_ids"]
        ids = ids + [self.tokenizer.eos_token_id]
        self.sampled.append(ids)
        return [[GenerationOutput(ids, [-0.25] * len(ids), "stop")] for _ in prompts]


# ---------------------------------------------------------------------------- parsers
@pytest.mark.parametrize("name", sorted(FAMILIES.values()))
def test_round_trip_calls_and_final_answers(name):
    fmt = make_format(name)
    one, two = fmt.parse(fmt.format_calls([ADD_1_2])), fmt.parse(fmt.format_calls([ADD_1_2, ADD_3_4]))
    strip = ((lambda c: ToolCall(c.name, c.arguments, c.id)) if name == "mistral"
             else (lambda c: ToolCall(c.name, c.arguments)))
    assert one.calls == [strip(ADD_1_2)] and not one.errors
    assert two.calls == [strip(ADD_1_2), strip(ADD_3_4)] and not two.errors
    answer = fmt.parse("<answer>3</answer>")
    assert not answer.items and answer.final_text == "<answer>3</answer>"


@pytest.mark.parametrize("name, text, kinds", [
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', []),
    ("llama3_json", '{"name": "add", "arguments": {"a": 1, "b": 2}}; {"name": "add"}', []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', ["not_json"]),
    ("llama3_json", '{"parameters": {}}', ["missing_name"]),
    ("llama3_json", '{"name": "add", "parameters": [1, 2]}', ["bad_arguments"]),
    ("llama3_json", '{"name": "add", "parameters": {}}; {"name": ', ["invalid_json"]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": "{\\"a\\": 1}", "id": "abcdefghi"}]', []),
    ("mistral", "[TOOL_CALLS]add[ARGS]{\"a\": 1, \"b\": 2}[TOOL_CALLS]add{\"a\": 3}", []),
    ("mistral", "[TOOL_CALLS] []", ["empty"]),
    ("mistral", "[TOOL_CALLS]", ["empty"]),
    ("mistral", "[TOOL_CALLS] [1, {\"name\": \"add\"}]", ["not_object"]),
    ("mistral", "[TOOL_CALLS]add[ARGS]{\"a\": ", ["invalid_json"]),
    ("mistral", "[TOOL_CALLS]add", ["invalid_json"]),
    ("json", '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"b": 2}}]', []),
    ("json", '{"answer": 3}', ["missing_name"]),
    ("json", "[" * 100000, ["invalid_json"]),
    ("hermes", "<tool_call>[1]</tool_call>", ["not_object"]),
])
def test_malformed_calls_are_error_entries(name, text, kinds):
    result = make_format(name).parse(text)
    assert [e.split(":")[0] for e in result.errors] == kinds
    assert result.has_calls


@pytest.mark.parametrize("name", sorted(FAMILIES.values()))
def test_parsers_never_raise_on_cut_or_garbled_text(name):
    fmt = make_format(name)
    text = fmt.format_calls([ADD_1_2, ToolCall("lookup", {"q": "a \"quoted\" {brace} [x]; y"})])
    rng = random.Random(0)
    for end in range(len(text) + 1):
        fmt.parse(text[:end])
    for _ in range(300):
        chars = list(text)
        for _ in range(3):
            chars[rng.randrange(len(chars))] = rng.choice('{}[]";:, x\\')
        fmt.parse("".join(chars))


# ---------------------------------------------------------------------------- detection
def test_format_detected_from_each_family_template():
    for family, name in FAMILIES.items():
        tokenizer = build_family_tokenizer(family)
        expected = None if name == "json" else name  # a bare-JSON template has no marker to find
        assert detect_format(tokenizer.chat_template) == expected
        assert resolve_format("", tokenizer).name == (expected or "hermes")
        assert resolve_format("json", tokenizer).name == "json"
    assert resolve_format("", build_char_tokenizer()).name == "hermes"  # tamer's own ChatML template


def test_unknown_format_names_the_config_field():
    from tamer.config import ConfigError, load_config
    from tamer.pipeline import RunConfig

    with pytest.raises(ConfigError, match="^agent.tool_format: unknown tool-call format 'openai'; valid: hermes, json, "
                                          "llama3_json, mistral"):
        load_config(RunConfig, overrides=["agent.tool_format=openai"])
    with pytest.raises(ValueError, match="^tool_format: unknown"):
        AgentConfig(tool_format="openai")
    assert set(TOOL_FORMATS.names()) == set(FAMILIES.values())


def test_markers_survive_decoding_and_eos_does_not():
    for family, marker in (("mistral", "[TOOL_CALLS]"), ("llama3", "<|python_tag|>")):
        tokenizer = build_family_tokenizer(family)
        fmt = resolve_format("", tokenizer)
        ids = tokenizer(f"{marker}{{\"x\": \"é\"}}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert tokenizer.convert_tokens_to_ids(marker) in ids
        assert turn_decoder(tokenizer, fmt)(ids) == f"{marker}{{\"x\": \"é\"}}"


def test_hermes_answers_in_one_message_unless_the_template_wraps_responses():
    result = [(ADD_1_2, "3"), (None, "error: x")]
    assert make_format("hermes", build_char_tokenizer()).observation(result) == \
        "<tool_response>3</tool_response>\n<tool_response>error: x</tool_response>"
    qwen = build_family_tokenizer("qwen2.5")
    messages = make_format("hermes", qwen).observation(result)
    assert messages == [{"role": "tool", "content": "3"}, {"role": "tool", "content": "error: x"}]
    text = ToolMessageRenderer(qwen).text(messages)
    assert text == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nerror: x\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- episodes
def _spans(traj):
    """The runs of loss_mask == 1 and == 0 in the completion, in order, as (mask, ids)."""
    runs = []
    for token, m in zip(traj.completion_ids, traj.loss_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


def _assistant(call_or_calls):
    calls = call_or_calls if isinstance(call_or_calls, list) else [call_or_calls]
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}


def _tool(call, content, name):
    message = {"role": "tool", "content": content}
    if name == "mistral" and call is not None:
        message["tool_call_id"] = call.id
    return message


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_episode_through_family_template(family):
    """A four-turn episode: one call, two calls, a malformed call, the answer.

    The token sequence is the family template's rendering of the same conversation, the
    trained tokens are the sampled ones (with their logprobs), every environment token is
    masked, and the malformed call is answered with an error the agent can read.
    """
    name = FAMILIES[family]
    tokenizer = build_family_tokenizer(family)
    fmt = make_format(name, tokenizer)
    turns = [fmt.format_calls([ADD_1_2]), fmt.format_calls([ADD_1_2, ADD_3_4]), MALFORMED[name], "<answer>3</answer>"]
    engine = _Scripted(tokenizer, turns)
    rollout = AgentRollout(engine, tokenizer, AgentConfig(max_turns=6, max_total_tokens=4000, tool_format=name if
                                                           name == "json" else ""))
    traj = rollout.run([TASK], SamplingParams(n=1, max_new_tokens=400))[0]
    assert rollout.tool_format.name == name
    assert [t.errors for t in traj.turns] == [[], [], ["malformed_call"], []] and traj.info["success"] is True
    assert traj.turns[1].tool_results[:2] == ["3", "7"] and "error: malformed tool call (invalid_json" in \
        "".join(traj.turns[2].tool_results)

    # Trained tokens == sampled tokens, with their sampling logprobs; environment tokens masked.
    batch = collate([traj], torch.zeros(1), tokenizer.pad_token_id)
    p = len(traj.prompt_ids)
    row_mask = batch.loss_mask[0, p:p + len(traj.completion_ids)]
    trained = batch.input_ids[0, p:p + len(traj.completion_ids)][row_mask == 1].tolist()
    assert trained == [t for ids in engine.sampled for t in ids]
    assert batch.old_logprobs[0, p:p + len(traj.completion_ids)][row_mask == 1].eq(-0.25).all()
    spans = _spans(traj)
    assert [m for m, _ in spans] == [1, 0, 1, 0, 1, 0, 1]
    assert [ids for m, ids in spans if m == 1] == engine.sampled

    # The whole sequence is the template's rendering of the conversation.
    results = [t.tool_results for t in traj.turns]
    conversation = [dict(TASK.messages[0]),
                    _assistant(ADD_1_2), _tool(ADD_1_2, "3", name),
                    _assistant([ADD_1_2, ADD_3_4]), _tool(ADD_1_2, "3", name), _tool(ADD_3_4, "7", name),
                    {"role": "assistant", "content": MALFORMED[name]}, *[_tool(None, r, name) for r in results[2]],
                    {"role": "assistant", "content": "<answer>3</answer>"}]
    expected = tokenizer.apply_chat_template(conversation, tools=rollout._start(TASK, 0).env.tools, tokenize=False)
    got = tokenizer.decode(traj.prompt_ids + traj.completion_ids)
    assert got == expected.removesuffix("\n")  # ChatML ends the last turn with a newline the model never samples
    assert traj.prompt_ids + traj.completion_ids == tokenizer(got, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_demonstrations_replay_in_the_family_format(family):
    """Hermes-written demonstrations become the family's calls, and the environment runs them."""
    tokenizer = build_family_tokenizer(family)
    name = FAMILIES[family]
    source = CalculatorTasks()
    task = source.split()[1][0]
    turns = source.demonstrate_turns(task, random.Random(0))
    rollout = AgentRollout(None, tokenizer, AgentConfig(max_turns=10, max_total_tokens=4000, tool_format=name))
    traj = rollout.replay(task, turns)
    assert traj.info["success"] is True and traj.num_errors == 0 and traj.num_tool_calls == len(turns) - 1
    generated = tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.loss_mask) if m == 1])
    marker = {"hermes": "<tool_call>\n{\"name\": \"calculate\"",
              "llama3_json": "{\"name\": \"calculate\", \"parameters\"",
              "mistral": "[TOOL_CALLS] [{\"name\": \"calculate\"", "json": "{\"name\": \"calculate\", \"arguments\""}
    assert marker[name] in generated or (name == "hermes" and "<tool_call>{\"name\":\"calculate\"" in generated)


class _Answering:
    """Answers every turn in the rollout's format, whatever the model wrote (random weights)."""

    def use_tool_format(self, fmt):
        self.fmt = fmt

    def reset(self, task):
        self.turn = 0
        return ""

    def step(self, action):
        self.turn += 1
        return StepResult(self.fmt.observation([(ADD_1_2, f"result {self.turn}")]), done=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sampled_multi_turn_tokens_are_what_the_learner_scores(family):
    """A real model and engine over three turns: the learner's logprobs of the trained tokens
    equal the sampling logprobs, which holds only if the trained tokens are the sampled ones in
    the sampled context (template-rendered tool messages, prefix reuse across turns)."""
    tokenizer = build_family_tokenizer(family)
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                        intermediate_size=64)).eval()
    task = Task(id="t", messages=({"role": "user", "content": "hi"},), answer="", env="x")
    rollout = AgentRollout(HFEngine(model, tokenizer.pad_token_id), tokenizer,
                           AgentConfig(max_turns=3, max_total_tokens=400, show_tools=False),
                           env_factory=lambda t: _Answering())
    trajs = rollout.run([task, task], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=2))
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    with torch.no_grad():
        learner = token_logprobs(model, batch.input_ids, batch.attention_mask)
    on = batch.loss_mask.bool()
    torch.testing.assert_close(learner[on], batch.old_logprobs[on], atol=1e-4, rtol=1e-4)
    for traj in trajs:
        assert len(traj.turns) == 3
        masked = tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.loss_mask) if m == 0])
        assert masked.count("result 1") == 1 and masked.count("result 2") == 1


def test_cli_demo_in_another_tool_format(tmp_path):
    """`--set agent.tool_format=llama3_json`: the demonstrations are replayed (and the agent trained)
    in Llama's JSON format; a Hermes parser would see no calls and the demonstrator would fail."""
    import json

    from typer.testing import CliRunner

    from tamer.cli import app

    out = tmp_path / "calc"
    args = ["demo", "--env", "calculator", "-o", str(out), "--set", "agent.tool_format=llama3_json",
            "--set", "task.calculator.train_size=24", "--set", "task.calculator.heldout_size=4",
            "--set", "model.tiny.hidden_size=32", "--set", "model.tiny.num_layers=1",
            "--set", "model.tiny.intermediate_size=64",
            "--set", "sft.steps=2", "--set", "sft.batch_size=4", "--set", "rl.steps=1",
            "--set", "rl.prompts_per_step=2", "--set", "rl.group_size=2", "--set", "rl.max_new_tokens=8",
            "--set", "eval.size=4", "--set", "eval.max_new_tokens=8", "--set", "tracking.tensorboard=false"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["agent"]["tool_format"] == "llama3_json"
    assert summary["demonstrator"]["success_rate"] == 1.0 and summary["demonstrator"]["error_rate"] == 0.0
