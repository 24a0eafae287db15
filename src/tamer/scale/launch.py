"""Start the learner ranks with torchrun and wait for them: what `tamer train` does when
`scale.learner_ranks > 1` (or `scale.learner_strategy` is ddp/fsdp2).

    result = launch_ranks(config, model, tokenizer, resume=False)   # in the CLI's process

The CLI's process keeps the output directory's lock and the signal handling; it writes the
run's spec to `OUTPUT_DIR/rl/ranks/spec.json` and runs

    python -m torch.distributed.run --standalone --nproc-per-node N -m tamer.scale.rank SPEC

Every rank joins the process group (gloo on CPU, nccl with CUDA), builds the same model and runs
the same RL job (`tamer.pipeline.rl_job`) with a `DistributedLearner`; rank 0 also rolls out
(in process or on Ray actors), evaluates, logs and writes checkpoints, the model and
`summary.json`, which the CLI's process returns. A model handed in (the demo's SFT model) is
saved to `OUTPUT_DIR/rl/ranks/start_model` for the ranks to load, and the trained weights are
loaded back into it at the end.

Stopping: SIGTERM/SIGINT to the CLI's process writes `OUTPUT_DIR/rl/ranks/stop`; rank 0 sees it
between steps, every rank checkpoints and the CLI exits 143/130 as a one-process run does. A
rank that dies makes torchrun end the others; the CLI reports it in one line and `--resume`
continues from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tamer.errors import RunError

STOP_FILE_ENV = "TAMER_STOP_FILE"  # rank 0 stops between steps once this file exists


class LearnerRankError(RunError):
    """A learner rank died (crash, OOM, killed); the run stopped."""


def launch_ranks(config, model=None, tokenizer=None, *, resume: bool | str = False,
                 initial_eval: dict[str, float] | None = None) -> dict[str, Any]:
    """Run the RL phase of `config` on `config.scale.learner_ranks` torchrun ranks; returns rank 0's result."""
    from tamer.config import to_dict
    from tamer.models import save_model
    from tamer.stopping import TrainingStopped, stop_requested

    work = Path(config.output_dir) / "rl" / "ranks"
    work.mkdir(parents=True, exist_ok=True)
    stop_file = work / "stop"
    stop_file.unlink(missing_ok=True)
    (work / "result.json").unlink(missing_ok=True)
    if model is not None:  # the ranks load the model they are given from disk
        start = save_model(model, tokenizer, work / "start_model")
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(start)))
    spec = {"config": to_dict(config), "resume": resume, "initial_eval": initial_eval,
            "result": str(work / "result.json")}
    (work / "spec.json").write_text(json.dumps(spec, default=str))
    env = dict(os.environ, **{STOP_FILE_ENV: str(stop_file)})
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={config.scale.learner_ranks}", "-m", "tamer.scale.rank", str(work / "spec.json")]
    # Its own session: a Ctrl-C reaches this process only, which asks the ranks to stop between steps.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        while proc.poll() is None:
            if stop_requested() and not stop_file.exists():
                stop_file.write_text("stop\n")
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    result = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else None
    if result is not None and result.get("stopped"):
        raise TrainingStopped("rl", result["step"], Path(result["checkpoint"]) if result["checkpoint"] else None,
                              signum=result.get("signum"), total_steps=config.rl.steps)
    if proc.returncode != 0 or result is None:
        raise LearnerRankError(f"learner ranks failed (torchrun exit {proc.returncode}; the ranks' output is above); "
                          f"run the same command with --resume to continue from the last checkpoint in "
                          f"{Path(config.output_dir) / 'rl' / 'checkpoints'}")
    if model is not None:
        from tamer.checkpoint import load_weights

        load_weights(result["model_path"], model)
    return result


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the CLI's process dies (Linux), so no rank is orphaned."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_file_requested() -> bool:
    """Whether the launching process asked the ranks to stop (checked by rank 0 between steps)."""
    path = os.environ.get(STOP_FILE_ENV)
    return bool(path) and os.path.exists(path)


class QuietTracker:
    """The tracker of ranks other than 0: they train, rank 0 logs."""

    def __enter__(self) -> QuietTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: 0
