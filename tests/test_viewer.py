"""`tamer view`: the page's structure and embedded data, parsed as HTML (no browser needed)."""

from __future__ import annotations

import json
import random
import urllib.request
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from tamer.cli import app
from tamer.rollout.agent import AgentConfig, AgentRollout
from tamer.rollout_log import TokenTexts, read_rollouts, trajectory_record
from tamer.tasks import TaskConfig, get_task_source
from tamer.viewer import page_data, render_page, serve_in_thread, write_page

runner = CliRunner()

TINY_DEMO = ["--set", "model.tiny.hidden_size=32", "--set", "model.tiny.num_layers=1",
             "--set", "model.tiny.intermediate_size=64", "--set", "sft.steps=10", "--set", "rl.steps=2",
             "--set", "rl.prompts_per_step=3", "--set", "rl.group_size=4", "--set", "eval.size=6",
             "--set", "rl.eval_every=1", "--set", "tracking.tensorboard=false",
             # length gives every group spread, so advantages are not all zero
             "--set", "reward.weights={correctness: 1.0, length: 1.0}",
             "--set", "reward.params={length: {max_tokens: 32}}"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("view") / "demo"
    result = runner.invoke(app, ["demo", "-o", str(out), *TINY_DEMO])
    assert result.exit_code == 0, result.output
    return out


class PageParser(HTMLParser):
    """Ids, tags with external references, and the text of each <script>."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.external: list[tuple[str, str]] = []
        self.scripts: list[tuple[dict, str]] = []
        self._script: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        for key in ("src", "href"):
            if attrs.get(key):
                self.external.append((tag, attrs[key]))
        if tag == "script":
            self._script = attrs
            self.scripts.append((attrs, ""))

    def handle_data(self, data):
        if self._script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None


def parse(html: str) -> tuple[PageParser, dict]:
    parser = PageParser()
    parser.feed(html)
    data = [json.loads(text) for attrs, text in parser.scripts if attrs.get("id") == "tamer-data"]
    assert len(data) == 1
    return parser, data[0]


def test_view_cli_writes_a_self_contained_page_with_the_runs_data(demo_run):
    result = runner.invoke(app, ["view", str(demo_run)])
    assert result.exit_code == 0, result.output
    html = (demo_run / "view.html").read_text(encoding="utf-8")
    parser, data = parse(html)
    # No network: nothing loaded by reference, the script and the style inline.
    assert parser.external == [] and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert {"tab-rollouts", "tab-curves", "filter-kind", "filter-step", "filter-rmin", "filter-rmax",
            "filter-errors", "filter-truncated", "filter-text", "groups", "charts", "count"} <= parser.ids
    assert any(not attrs and "renderRollouts" in text for attrs, text in parser.scripts)

    saved = read_rollouts(demo_run / "sft") + read_rollouts(demo_run / "rl")
    assert data["rollouts"] == json.loads(json.dumps(saved))
    train = [r for r in saved if r["kind"] == "train"]
    evals = [r for r in saved if r["kind"] == "eval" and r["phase"] == "rl"]
    sft_evals = [r for r in saved if r["phase"] == "sft"]
    # 2 groups (tracking.rollouts.groups_per_step) x 4 attempts per step; every held-out episode at
    # each evaluation: the SFT model's (the RL curve's step 0) and after RL steps 1 and 2
    assert sorted({r["step"] for r in train}) == [1, 2] and len(train) == 2 * 2 * 4
    assert sorted({r["step"] for r in evals}) == [1, 2] and len(evals) == 2 * 6
    assert {r["step"] for r in sft_evals} == {10} and len(sft_evals) == 6 and {r["kind"] for r in sft_evals} == {"eval"}
    for r in saved:
        assert len(r["tokens"]) == len(r["loss_mask"]) and sum(r["loss_mask"]) == r["num_generated"]
        assert "".join(r["tokens"]) == r["completion"]
        assert set(r["rewards"]) == {"correctness", "length"} and r["weights"] == {"correctness": 1.0, "length": 1.0}
        assert r["reward"] == pytest.approx(r["rewards"]["correctness"] + r["rewards"]["length"])
        assert r["weight_version"] is None
        assert (r["advantage"] is None) == (r["kind"] == "eval")
        if r["kind"] == "train":
            assert 0.0 <= r["logprob_gap"] < 1e-3  # sampler and learner are one fp32 module
    for step in (1, 2):  # GRPO: advantages within a group sum to zero
        for group in {r["group"] for r in train if r["step"] == step}:
            assert (sum(r["advantage"] for r in train if r["step"] == step and r["group"] == group)
                    == pytest.approx(0, abs=1e-5))

    summary = json.loads((demo_run / "summary.json").read_text())
    assert data["baselines"]["eval/accuracy"] == {"demonstrator": summary["demonstrator_accuracy"],
                                                  "SFT": summary["sft_accuracy"]}
    assert [r["step"] for r in data["metrics"]["rl"] if "eval/accuracy" in r] == [0, 1, 2]
    assert "sft/loss" in data["metrics"]["sft"][0]
    assert data["summary"]["task"] == "arithmetic"


def test_multi_turn_records_keep_turns_tool_calls_and_masks(tokenizer, tmp_path):
    source = get_task_source(TaskConfig(name="calculator"))
    tasks = source.split()[1][:3]
    replayer = AgentRollout(None, tokenizer, AgentConfig(max_turns=8, max_total_tokens=2048))
    rng = random.Random(0)
    texts = TokenTexts(tokenizer)
    records = []
    for i, task in enumerate(tasks):
        traj = replayer.replay(task, source.demonstrate_turns(task, rng))
        traj.group_id = i
        records.append(trajectory_record(traj, texts, kind="eval", step=0))
    for r in records:
        assert len(r["turns"]) >= 2 and r["num_tool_calls"] >= 1
        covered = 0
        for turn in r["turns"]:
            start, end, env_end = turn["span"]
            assert start == covered and start < end <= env_end
            assert all(r["loss_mask"][start:end]) and not any(r["loss_mask"][end:env_end])
            assert "".join(r["tokens"][start:end]) == turn["text"]
            covered = env_end
        assert covered == len(r["tokens"])
        calls = [c for t in r["turns"] for c in t["tool_calls"]]
        results = [res for t in r["turns"] for res in t["tool_results"]]
        assert calls[0]["name"] == "calculate" and len(results) >= len(calls)
        assert any(res in t["env_text"] for t in r["turns"] for res in t["tool_results"][:1])
    run = tmp_path / "agent" / "rl"
    run.mkdir(parents=True)
    (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _, data = parse(render_page(page_data(tmp_path / "agent")))
    assert data["rollouts"][0]["turns"][0]["tool_calls"] == records[0]["turns"][0]["tool_calls"]


def test_strict_json_and_script_safe_embedding(tmp_path):
    run = tmp_path / "rl"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "time": 0.1, "eval/accuracy": NaN}\n')
    record = {"kind": "eval", "step": 0, "group": 0, "sample": 0, "completion": "</script><!-- x",
              "task": {"id": "t", "messages": [{"role": "user", "content": "</script>"}], "answer": "1"}}
    (run / "rollouts.jsonl").write_text(json.dumps(record) + "\n")
    html = render_page(page_data(tmp_path))
    _, data = parse(html)
    assert data["metrics"]["rl"][0]["eval/accuracy"] is None  # NaN is not JSON
    assert data["rollouts"][0]["completion"] == "</script><!-- x"
    assert html.count("</script>") == 2  # the data block's and the code's own


def test_serve_binds_to_localhost_and_serves_the_page(tmp_path):
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "metrics.jsonl").write_text('{"step": 1, "time": 0.1, "reward/mean": 0.5}\n')
    page = write_page(tmp_path)
    server, url = serve_in_thread(page)
    try:
        assert server.server_address[0] == "127.0.0.1" and url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and response.read().decode() == page.read_text()
    finally:
        server.shutdown()
        server.server_close()


def test_view_of_an_empty_directory_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["view", str(tmp_path)])
    assert result.exit_code == 2
    assert "no metrics.jsonl or rollouts.jsonl" in result.output and len(result.output.strip().splitlines()) <= 3
