"""Nothing lost, nothing left behind (slow tier: real processes and real signals).

SIGTERM/SIGINT during SFT and RL, a second signal, two runs in one output directory, a
killed lock holder, a supervisor of the sandbox killed by SIGKILL/SIGTERM while a daemon
runs, a really full disk (a small tmpfs, as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tamer.tracking import read_metrics

pytestmark = pytest.mark.slow

SETS = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "sft.batch_size=4", "sft.log_every=1", "rl.prompts_per_step=4", "rl.group_size=4",
        "rl.max_new_tokens=16", "eval.size=4", "eval.max_new_tokens=6", "rl.eval_every=0",
        "tracking.tensorboard=false", "tracking.console=false", "model.threads=1",
        "task.arithmetic.train_size=64", "task.arithmetic.heldout_size=16"]


def _cli(*args: str, sets=()) -> list[str]:
    return [sys.executable, "-m", "tamer.cli", *args, *(a for s in (*SETS, *sets) for a in ("--set", s))]


def _spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float = 120.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(every)


def _logged_step(run_dir: Path, step: int) -> bool:
    try:
        return any(r["step"] >= step for r in read_metrics(run_dir))
    except (OSError, ValueError):
        return False


def _records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in read_metrics(run_dir)]


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


# ---------------------------------------------------------------------------- signals during training
@pytest.mark.parametrize("command, phase, signum", [("train", "rl", signal.SIGTERM), ("sft", "sft", signal.SIGINT)])
def test_signal_stops_after_the_step_and_resume_is_bitwise_exact(tmp_path, command, phase, signum):
    from tamer.config import load_config
    from tamer.pipeline import RunConfig, run_rl, run_sft

    steps = [f"{phase}.steps=40"]
    part = tmp_path / "part"
    proc = _spawn(_cli(command, "-o", str(part), sets=steps))
    _wait_for(lambda: _logged_step(part / phase, 2) or proc.poll() is not None)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, (out, err)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"stopped by {signal.Signals(signum).name} after {phase} step")
    summary = json.loads((part / phase / "summary.json").read_text())
    stopped_at = summary["step"]
    assert summary["stopped"] and 2 <= stopped_at < 40
    assert (part / phase / "checkpoints" / f"step-{stopped_at:06d}" / "trainer_state.pt").is_file()
    assert max(r["step"] for r in read_metrics(part / phase)) == stopped_at  # the step it was in was finished

    resumed = subprocess.run(_cli(command, "-o", str(part), "--resume", sets=steps), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    full = tmp_path / "full"
    job = run_rl if phase == "rl" else run_sft
    job(load_config(RunConfig, None, [*SETS, *steps, f"output_dir={full}"]))
    assert _records(part / phase) == _records(full / phase)
    reference = _weights(full / phase / "model")
    for name, tensor in _weights(part / phase / "model").items():
        assert torch.equal(tensor, reference[name]), name


def test_second_signal_exits_at_once(tmp_path):
    out = tmp_path / "run"
    long_steps = ["rl.steps=50", "rl.prompts_per_step=16", "rl.max_new_tokens=160",
                  "model.tiny.max_position_embeddings=512"]
    proc = _spawn(_cli("train", "-o", str(out), sets=long_steps))
    _wait_for(lambda: _logged_step(out / "rl", 1) or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGTERM  # ended by the signal itself, not by the clean stop (143)
    assert time.monotonic() - sent < 2.0
    assert "SIGTERM received" in proc.stderr.read()
    assert not (out / "rl" / "summary.json").exists()


# ---------------------------------------------------------------------------- the output-dir lock across processes
def test_two_runs_in_one_output_dir(tmp_path):
    out = tmp_path / "run"
    first = _spawn(_cli("train", "-o", str(out), sets=["rl.steps=5000"]))
    lock = out / ".tamer-lock"
    _wait_for(lambda: lock.exists() and f'"pid": {first.pid}' in lock.read_text())
    second = subprocess.run(_cli("train", "-o", str(out), sets=["rl.steps=30"]), capture_output=True, text=True)
    assert first.poll() is None  # refused while the first still runs
    assert second.returncode == 2
    message = " ".join(second.stdout.split())
    assert f"{out}: in use by another run (pid {first.pid}" in message
    first.send_signal(signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGTERM, stdout + stderr
    for line in (out / "rl" / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # no interleaved writes from the refused run
    summary = json.loads((out / "rl" / "summary.json").read_text())
    assert summary["total_steps"] == 5000  # the first run's, untouched by the second


def test_lock_of_a_killed_run_is_free_at_once(tmp_path):
    from tamer.runlock import output_dir_lock

    out = tmp_path / "run"
    proc = _spawn(_cli("train", "-o", str(out), sets=["rl.steps=500"]))
    lock = out / ".tamer-lock"
    _wait_for(lambda: lock.exists() and f'"pid": {proc.pid}' in lock.read_text())
    proc.kill()
    proc.wait()
    with output_dir_lock(out):  # no stale lock to remove by hand
        assert json.loads(lock.read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------------------- the sandbox outlives no supervisor
DAEMON = textwrap.dedent("""
    import os, time
    if os.fork() == 0:
        os.setsid()                         # out of the session: killpg would miss it
        if os.fork() == 0:
            os.dup2(os.open(os.devnull, os.O_RDWR), 1)
            os.dup2(1, 2)
            time.sleep(600)
        os._exit(0)
    time.sleep(600)
""")
LIBRARY_SUPERVISOR = ("import sys\nfrom tamer.tools.sandbox import SandboxConfig, SandboxPool\n"
                      "with SandboxPool(1) as pool:\n"
                      "    pool.submit(open(sys.argv[1]).read(), config=SandboxConfig(timeout_s=60)).result()\n")


def _cwd(pid: int) -> str | None:
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _marked(pid: int) -> bool:
    try:
        return any(v.startswith(b"TAMER_SANDBOX=") for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return False


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _program_workdir(supervisor: int) -> str | None:
    """The workdir of the sandboxed program the supervisor started (its marked child's cwd)."""
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        if _ppid(pid) == supervisor and _marked(pid):
            return _cwd(pid)
    return None


def _in(workdir: str) -> list[int]:
    """Live processes working in `workdir`: the program, what it started, the reaper."""
    return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if (_cwd(pid) or "").startswith(workdir)]


def _pid_namespaces_allowed() -> bool:
    """Can this process create a PID namespace (as root, or through a user namespace)?"""
    import ctypes

    pid = os.fork()
    if pid == 0:
        flags = 0x20000000 | (0 if os.geteuid() == 0 else 0x10000000)  # CLONE_NEWPID (| CLONE_NEWUSER)
        os._exit(0 if ctypes.CDLL(None, use_errno=True).unshare(flags) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.parametrize("how, signum", [("cli", signal.SIGKILL), ("cli", signal.SIGTERM), ("library", signal.SIGKILL)])
def test_killed_supervisor_leaves_no_process_and_no_workdir(tmp_path, how, signum):
    if not _pid_namespaces_allowed():
        pytest.skip("this machine refuses PID namespaces (see docs/sandbox.md, 'No PID namespace')")
    program = tmp_path / "daemon.py"
    program.write_text(DAEMON)
    cmd = ([sys.executable, "-m", "tamer.cli", "sandbox", "run", str(program), "--timeout", "60"] if how == "cli"
           else [sys.executable, "-c", LIBRARY_SUPERVISOR, str(program)])
    supervisor = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workdir = None
    try:
        _wait_for(lambda: _program_workdir(supervisor.pid) is not None, timeout=60)
        workdir = _program_workdir(supervisor.pid)
        _wait_for(lambda: sum(map(_marked, _in(workdir))) >= 2, timeout=30)  # the program and its daemon
        assert Path(workdir).is_dir()
        os.kill(supervisor.pid, signum)
        killed = time.monotonic()
        _wait_for(lambda: not _in(workdir) and not Path(workdir).exists(), timeout=2.0)
        assert time.monotonic() - killed <= 2.0
    finally:
        supervisor.kill()
        supervisor.wait()
        for pid in _in(workdir) if workdir else ():  # if the test failed: leave nothing running
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- a really full disk
@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.decode().strip()}); "
                    "test_robustness.py injects ENOSPC instead")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(directory: Path) -> None:
    """Write zeros into `directory` until its filesystem is full."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.parametrize("when", ["checkpoint", "final model"])
def test_really_full_disk_is_one_line_and_leaves_no_half_model(small_tmpfs, monkeypatch, when):
    import tamer.pipeline
    from tamer.config import load_config
    from tamer.pipeline import RunConfig, run_rl
    from tamer.storage import StorageError
    from tamer.trainers.rl import RLTrainer

    out = small_tmpfs / "run"
    if when == "checkpoint":
        original = RLTrainer.save_checkpoint
        monkeypatch.setattr(RLTrainer, "save_checkpoint", lambda self: (_fill(small_tmpfs), original(self))[1])
    else:
        original = tamer.pipeline.save_model
        monkeypatch.setattr(tamer.pipeline, "save_model", lambda *a: (_fill(small_tmpfs), original(*a))[1])
    config = load_config(RunConfig, None, [*SETS, "rl.steps=2", f"output_dir={out}",
                                           f"rl.checkpoint_every={1 if when == 'checkpoint' else 0}"])
    with pytest.raises(StorageError) as info:
        run_rl(config)
    message = str(info.value)
    assert "\n" not in message and "no space left on device" in message
    target = out / "rl" / ("checkpoints/step-000001" if when == "checkpoint" else "model")
    assert message.startswith(f"{target}: cannot write"), message
    assert not (out / "rl" / "model").exists()  # never a half model
    leftovers = [p.name for p in (out / "rl").rglob("*") if ".tmp" in p.name]
    assert leftovers == []
