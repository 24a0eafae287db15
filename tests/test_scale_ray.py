"""Ray rollout workers on a local Ray instance (slow tier: starting Ray and its actors takes ~1 min).

`RayRollout` with 2 actors returns what one process returns (tokens, masks, logprobs, group ids),
single-turn and multi-turn; weights are versioned; an actor that dies mid-rollout is replaced and
its groups re-run, and the call still returns every trajectory.
"""

import pytest
import torch

ray = pytest.importorskip("ray")

from tamer.models import build_char_tokenizer, build_tiny_model, stop_token_ids  # noqa: E402
from tamer.rollout.agent import AgentConfig  # noqa: E402
from tamer.rollout.engine import HFEngine  # noqa: E402
from tamer.rollout.runner import Rollout  # noqa: E402
from tamer.rollout.types import SamplingParams  # noqa: E402
from tamer.scale.ray_rollout import RayRollout, WorkerSpec, start_ray  # noqa: E402
from tamer.tasks import ArithmeticTasks  # noqa: E402
from tests.conftest import TINY  # noqa: E402
from tests.scale_envs import echo_tasks  # noqa: E402

pytestmark = pytest.mark.slow
AGENT = AgentConfig(max_turns=3, env_threads=4)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TINY)
    owns = start_ray(num_cpus=4, object_store_mb=200)
    import sys

    spec = WorkerSpec(model.config, tokenizer, agent=AGENT, plugins=("tests.scale_envs",),
                      sys_path=tuple(p for p in sys.path if p))
    rollout = RayRollout(spec, workers=2, timeout_s=120)
    yield model, tokenizer, rollout
    rollout.close()
    if owns:
        ray.shutdown()


def _same(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert (a.group_id, a.completion_ids, a.loss_mask, a.finish_reason) == \
               (b.group_id, b.completion_ids, b.loss_mask, b.finish_reason)
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5


def _params(tokenizer, seed=11, n=3):
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=10, stop_token_ids=stop_token_ids(tokenizer), seed=seed)


def test_two_actors_equal_one_process_single_turn(setup):
    model, tokenizer, rollout = setup
    tasks = ArithmeticTasks().split()[0][:7]
    rollout.sync_weights(model, version=0)
    local = Rollout(HFEngine(model, tokenizer.pad_token_id), tokenizer, AGENT, seeding="trajectory")
    _same(local.run(tasks, _params(tokenizer), group_offset=4), rollout.run(tasks, _params(tokenizer), group_offset=4))


def test_two_actors_equal_one_process_multi_turn(setup):
    model, tokenizer, rollout = setup
    tasks = echo_tasks(5)
    rollout.sync_weights(model, version=0)
    local = Rollout(HFEngine(model, tokenizer.pad_token_id), tokenizer, AGENT, seeding="trajectory")
    got = rollout.run(tasks, _params(tokenizer, n=2))
    _same(local.run(tasks, _params(tokenizer, n=2)), got)
    assert all(len(t.turns) == 3 for t in got)


def test_new_weights_reach_the_actors_once_per_version(setup):
    model, tokenizer, rollout = setup
    tasks = ArithmeticTasks().split()[0][:4]
    changed = build_tiny_model(tokenizer, TINY)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    rollout.sync_weights(changed, version=1)
    assert ray.get([a.run.remote(tasks[:1], _params(tokenizer), 0) for a in rollout.actors])[0][0] == 1
    local = Rollout(HFEngine(changed, tokenizer.pad_token_id), tokenizer, seeding="trajectory")
    _same(local.run(tasks, _params(tokenizer)), rollout.run(tasks, _params(tokenizer)))
    rollout.sync_weights(model, version=1)  # the same version is not pushed again
    _same(local.run(tasks, _params(tokenizer)), rollout.run(tasks, _params(tokenizer)))
    rollout.sync_weights(model, version=2)


def test_an_actor_killed_mid_rollout_is_replaced_and_its_groups_rerun(setup, tmp_path):
    model, tokenizer, rollout = setup
    rollout.sync_weights(model, version=3)
    rollout.metrics()
    pids = ray.get([a.pid.remote() for a in rollout.actors])
    tasks = echo_tasks(4) [:2] + echo_tasks(2, env="crash_once", answer=str(tmp_path / "crashed"))
    got = rollout.run(tasks, _params(tokenizer, n=2))  # the actor running the crash_once groups dies once
    assert (tmp_path / "crashed").exists() and len(got) == 8
    assert [t.group_id for t in got] == [0, 0, 1, 1, 2, 2, 3, 3]
    counts = rollout.metrics()
    assert counts["scale/actor_restarts"] == 1 and counts["scale/groups_rerun"] == 2
    assert ray.get([a.pid.remote() for a in rollout.actors])[1] != pids[1]
    local = Rollout(HFEngine(model, tokenizer.pad_token_id), tokenizer, AGENT, seeding="trajectory")
    _same(local.run(echo_tasks(4)[:2], _params(tokenizer, n=2)), got[:4])  # the other actor's shard is untouched
    assert ray.get(rollout.actors[1].run.remote(tasks[:1], _params(tokenizer), 0))[0] == 3  # new actor has the weights


def test_a_hung_actor_is_replaced_after_the_timeout(setup):
    model, tokenizer, rollout = setup
    rollout.sync_weights(model, version=4)
    rollout.metrics()
    timeout, rollout.timeout_s = rollout.timeout_s, 3.0
    try:
        tasks = echo_tasks(2, answer="0.01") + echo_tasks(2, answer="0.01")
        slow = echo_tasks(2, answer="30")  # the second shard sleeps 30 s per step: hung
        got = None
        with pytest.raises(Exception, match="failed"):  # it stays hung after each replacement
            got = rollout.run(tasks[:2] + slow, _params(tokenizer, n=1))
        assert got is None and rollout.metrics()["scale/actor_restarts"] == rollout.max_restarts + 1
    finally:
        rollout.timeout_s = timeout
    rollout.sync_weights(model, version=5)
    assert len(rollout.run(tasks, _params(tokenizer, n=1))) == 4  # replaced actors work
