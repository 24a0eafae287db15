"""Learner ranks under torchrun (gloo, 2 processes) and the whole distributed run (slow tier).

* One update on 2 ranks (DDP, FSDP2; the PPO critic too) equals one process within 1e-6, on a
  batch whose rows, and so the ranks' token counts, differ in length (tests/distributed_update.py).
* `tamer train` with 2 rollout workers and 2 learner ranks: 4 steps match the one-process run
  (`rl.sampling_seed=trajectory`) metric for metric.
* FSDP2: rank 0 writes full checkpoints; `--resume` continues exactly.
* A learner rank killed mid-run stops the run with one line (exit 2); `--resume` finishes it.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed_update.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("strategy, advantage", [("ddp", "grpo"), ("fsdp2", "grpo"), ("fsdp2", "gae")])
def test_two_ranks_take_the_one_rank_step(tmp_path, strategy, advantage):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    _run([sys.executable, str(SCRIPT), "--advantage", advantage, "--out", str(one)])
    _run(TORCHRUN + [str(SCRIPT), "--strategy", strategy, "--advantage", advantage, "--out", str(two)])
    a, b = torch.load(one), torch.load(two)
    moved = max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])
    assert moved < 1e-6
    if advantage == "gae":
        assert max((a["critic"][k] - b["critic"][k]).abs().max().item() for k in a["critic"]) < 1e-6
        assert a["metrics"]["critic/value_loss"] == pytest.approx(b["metrics"]["critic/value_loss"], rel=1e-5)
    for key in ("train/loss", "train/policy_loss", "train/kl", "train/grad_norm", "train/clip_frac"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key
    # The test means something: the update changed the model, and the ranks' token counts differ.
    assert a["metrics"]["train/grad_norm"] > 0


@pytest.mark.parametrize("strategy, tied", [("fsdp2", 2), ("ddp", 5)])
def test_two_ranks_leave_out_zero_advantage_rows_as_one_rank_does(tmp_path, strategy, tied):
    """beta = 0, `tied` of 5 groups with equal rewards: their rows are left out (docs/algorithms.md#zero-advantage-
    rows), so the ranks run different numbers of rows (all 5: none on any rank, zero gradients stepped); the
    update is the one-rank update."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    args = ["--kl-coef", "0", "--tied-groups", str(tied)]
    _run([sys.executable, str(SCRIPT), "--out", str(one)] + args)
    _run(TORCHRUN + [str(SCRIPT), "--strategy", strategy, "--out", str(two)] + args)
    a, b = torch.load(one), torch.load(two)
    assert max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"]) < 1e-6
    assert a["metrics"]["tokens/learner_rows_skipped"] == 2 * tied
    for key in ("train/loss", "train/policy_loss", "train/grad_norm"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key
    assert (a["metrics"]["train/grad_norm"] > 0) == (tied < 5)


TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=64", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=8",
        "rl.eval_every=2", "eval.size=8", "eval.max_new_tokens=8", "rl.optim.lr=3e-3", "tracking.console=false",
        "reward.weights={correctness: 1.0, length: 1.0}", "reward.params={length: {max_tokens: 8}}",
        "rl.checkpoint_every=1"]


def _train(out, *sets, resume=False, check=True):
    cmd = [sys.executable, "-m", "tamer.cli", "train", "-o", str(out)]
    for item in TINY + list(sets):
        cmd += ["--set", item]
    cmd += ["--resume"] if resume else []
    if not check:
        return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _run(cmd)


def _metrics(out):
    rows = [json.loads(line) for line in (Path(out) / "rl" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def _close(a, b, steps):
    for step in steps:
        keys = [k for k, v in a[step].items() if isinstance(v, float) and not (k.startswith(("time/", "scale/"))
                                                                               or k.endswith("_s") or k == "time")]
        assert len(keys) > 15
        for key in keys:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)


# The one-process reference runs recompute the learner's forward as the distributed runs must (their samplers
# are Ray workers or their trajectories go to other ranks: `rl.reuse_sampler_activations` does not apply there).
RECOMPUTE = "rl.reuse_sampler_activations=false"


def test_distributed_run_matches_one_process(tmp_path):
    _train(tmp_path / "one", "rl.steps=4", "rl.sampling_seed=trajectory", RECOMPUTE)
    _train(tmp_path / "dist", "rl.steps=4", "scale.rollout_workers=2", "scale.learner_ranks=2", "scale.ray_cpus=4",
           "scale.object_store_mb=200")
    one, dist = _metrics(tmp_path / "one"), _metrics(tmp_path / "dist")
    _close(one, dist, (1, 2, 3, 4))
    assert dist[4]["scale/rollout_workers"] == 2 and dist[4]["scale/actor_restarts"] == 0
    assert "eval/accuracy" in dist[4] and (tmp_path / "dist" / "rl" / "model" / "config.json").is_file()


def test_fsdp2_checkpoints_resume_exactly(tmp_path):
    _train(tmp_path / "full", "rl.steps=3", RECOMPUTE)
    _train(tmp_path / "part", "rl.steps=2", "scale.learner_ranks=2", "scale.learner_strategy=fsdp2")
    assert (tmp_path / "part" / "rl" / "checkpoints" / "step-000002" / "trainer_state.pt").is_file()
    _train(tmp_path / "part", "rl.steps=3", "scale.learner_ranks=2", "scale.learner_strategy=fsdp2", resume=True)
    _close(_metrics(tmp_path / "full"), _metrics(tmp_path / "part"), (1, 2, 3))


def _rank_pids(root_pid):
    """The torchrun workers (`tamer.scale.rank`) below `root_pid`, by LOCAL_RANK."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tamer.scale.rank" in cmd:
            rank = next((e.split(b"=", 1)[1] for e in environ if e.startswith(b"LOCAL_RANK=")), None)
            if rank is not None and str(root_pid).encode() in _ancestors(entry.name):
                out[int(rank)] = int(entry.name)
    return out


def _ancestors(pid):
    chain = []
    while pid not in ("0", "1"):
        try:
            pid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:
            break
        chain.append(pid.encode())
    return chain


def test_a_dead_rank_stops_the_run_cleanly_and_resume_finishes_it(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, "rl.steps=400", "scale.learner_ranks=2", check=False)  # far more than it gets to run
    checkpoints = out / "rl" / "checkpoints"
    deadline = time.monotonic() + 400
    # Any finished checkpoint (they rotate: a given step's may already be gone when polled).
    while not any(checkpoints.glob("step-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = _rank_pids(proc.pid)
    assert 1 in pids, (proc.poll(), proc.stdout.read() if proc.poll() is not None else "")
    os.kill(pids[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "learner ranks failed" in output and "--resume" in output, output[-2000:]
    done = max(int(p.name.split("-")[1]) for p in (out / "rl" / "checkpoints").glob("step-*"))
    _train(out, f"rl.steps={done + 1}", "scale.learner_ranks=2", resume=True)
    summary = json.loads((out / "rl" / "summary.json").read_text())
    assert summary["rl_steps"] == done + 1


def test_one_step_off_policy_still_learns_arithmetic(tmp_path):
    """The arithmetic demo (README: SFT 0.595, GRPO 0.91-0.99 after 40 steps) with rl.max_staleness=1:
    staleness never exceeds 1, and GRPO still teaches the carries the SFT model forgets."""
    from tamer.config import load_config
    from tamer.pipeline import RunConfig, run_demo
    from tamer.tracking import read_metrics

    torch.set_num_threads(2)
    config = load_config(RunConfig, [ROOT / "configs" / "demo-arithmetic.yaml"], [
        "rl.max_staleness=1", "tracking.console=false", f"output_dir={tmp_path}"])
    summary = run_demo(config)
    rows = [r for r in read_metrics(tmp_path / "rl" / "metrics.jsonl") if "async/staleness" in r]
    assert len(rows) == config.rl.steps and max(r["async/staleness"] for r in rows) == 1.0
    assert min(r["async/staleness"] for r in rows[1:]) == 1.0  # really one step off after the first
    assert summary["rl_accuracy"] > summary["sft_accuracy"] + 0.2, summary
