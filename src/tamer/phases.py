"""Run one phase of a run (SFT, evaluation, RL) in a fresh Python process and read its result.

    result = run_in_child("rl", config)                     # trains, evaluates, saves; returns a dict
    result = run_in_child("rl", config, measure_steps=2)    # only times 2 RL steps
    result["peak_rss_mb"], result["baseline_rss_mb"], result["seconds"]

`tamer compare` and `tamer advise` use it so that one method's allocations never count
against another: each phase's memory figure is its own process's peak resident set
(`tamer.memory`), which includes the interpreter, torch and transformers (`baseline_rss_mb`,
measured after the imports, before any model) — a cost every method pays.

The child is `python -m tamer.phases SPEC.json`; it imports the config's `plugins` before
checking the config, as the parent did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tamer.config import from_dict, import_plugins, to_dict
from tamer.memory import current_rss_mb, peak_rss_mb, rss_parts_mb
from tamer.models import count_parameters, save_model
from tamer.pipeline import RunConfig, build_policy, evaluate_model, make_trainer, run_sft, tracker_for
from tamer.tasks import get_task_source
from tamer.trainers.common import seed_everything

PHASES = ("sft", "eval", "rl")


class PhaseError(RuntimeError):
    """A phase's child process failed; the message carries the tail of its stderr."""


def run_in_child(phase: str, config: RunConfig, *, measure_steps: int = 0, quiet: bool = False,
                 timeout: float | None = None) -> dict[str, Any]:
    """Run one phase (`sft`, `eval`, `rl`) of `config` in a fresh Python process; returns its result dict.

    `measure_steps` > 0 (rl only) runs that many RL steps without evaluation and returns their
    seconds (`step_seconds`) instead of training to the end.
    """
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; valid: {', '.join(PHASES)}")
    with tempfile.TemporaryDirectory(prefix="tamer-phase-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec = {"phase": phase, "config": to_dict(config), "measure_steps": measure_steps, "result": str(result_path)}
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        # The child sees what this process sees (e.g. a test module registering a reward function).
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.run([sys.executable, "-m", "tamer.phases", str(spec_path)], env=env, stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=timeout)
        if proc.returncode != 0 or not result_path.is_file():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise PhaseError(f"phase {phase!r} failed (exit {proc.returncode}):\n{tail}")
        if proc.stderr and not quiet:
            sys.stderr.write(proc.stderr)
        return json.loads(result_path.read_text())


# ---------------------------------------------------------------------------- in the child
def _phase_sft(config: RunConfig, measure_steps: int) -> dict[str, Any]:
    model, tokenizer = build_policy(config.model, config.task)
    loaded = current_rss_mb()
    result = run_sft(config, model, tokenizer)
    return {**result, "rss_after_load_mb": loaded, "models_held": 1,
            "trainable_parameters": count_parameters(model, trainable_only=True)}


def _phase_eval(config: RunConfig, measure_steps: int) -> dict[str, Any]:
    """Held-out evaluation of `config.model` (a saved model given as model.path)."""
    model, tokenizer = build_policy(config.model, config.task)
    loaded = current_rss_mb()
    report = evaluate_model(model, tokenizer, get_task_source(config.task).split()[1], config)
    return {"sft_accuracy": report.accuracy, "model_path": config.model.path, "rss_after_load_mb": loaded,
            "models_held": 1, "trainable_parameters": count_parameters(model, trainable_only=True)}


def _phase_rl(config: RunConfig, measure_steps: int) -> dict[str, Any]:
    """Train (or, with `measure_steps`, only time) the RL method `config` names."""
    model, tokenizer = build_policy(config.model, config.task)
    seed_everything(config.rl.seed)
    loaded = current_rss_mb()
    start = time.perf_counter()
    with tracker_for(config, "rl", config.rl.steps, config.rl.algorithm.advantage) as tracker:
        trainer = make_trainer(config, model, tokenizer, tracker=tracker)
        final = {} if measure_steps else trainer.train()
        step_seconds = [_timed_step(trainer) for _ in range(measure_steps)]
    model_path = None
    if not measure_steps:
        model_path = str(save_model(model, tokenizer, Path(config.output_dir) / "rl" / "model"))
    held = trainer.held_models()
    return {"final": final, "model_path": model_path, "rl_seconds": time.perf_counter() - start,
            "rss_after_load_mb": loaded, "step_seconds": step_seconds, "models_held": len(held),
            "parameters_held": sum(count_parameters(m) for m in held),
            "trainable_parameters": trainer.trainable_parameters(),
            "metrics": str(tracker.metrics_path), "reward_errors": trainer.rewards.total_errors}


def _timed_step(trainer) -> float:
    """One RL step (collect, advantages, update) without evaluation; its wall-clock seconds."""
    start = time.perf_counter()
    trainer.train_step()
    return time.perf_counter() - start


def child_main(spec_path: str) -> None:
    baseline = current_rss_mb()  # interpreter + torch + transformers + tamer, before any model
    spec = json.loads(Path(spec_path).read_text())
    import_plugins(spec["config"].get("plugins") or ())
    config = from_dict(RunConfig, spec["config"])
    start = time.perf_counter()
    phase = {"sft": _phase_sft, "eval": _phase_eval, "rl": _phase_rl}[spec["phase"]]
    result = phase(config, spec["measure_steps"])
    result.update({"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline,
                   "rss_parts_mb": rss_parts_mb()})
    Path(spec["result"]).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    child_main(sys.argv[1])
