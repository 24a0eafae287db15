"""The `tamer` command line: demo, sft, train, eval, config, sandbox.

Every training command takes `--config FILE.yaml` (the layout of `RunConfig`; see
`tamer config show`) and any number of `--set section.field=value` overrides. The whole
config is checked before any work starts; a bad value names its field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from tamer.config import ConfigError, load_config, to_dict
from tamer.rollout.vllm.errors import VLLMEngineError
from tamer.tasks.dataset import DatasetError

app = typer.Typer(
    help="tamer: train LLM agents with reinforcement learning from verifiable feedback.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
console = Console()

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML file with RunConfig sections (model, task, reward, sft, rl, eval, tracking).")
SetOpt = typer.Option(None, "--set", "-s", help="Override one field, e.g. --set rl.steps=50 --set rl.optim.lr=1e-5 (repeatable).")
SeedOpt = typer.Option(None, "--seed", help="Seed for model init, data order and sampling (sets model.tiny.seed, sft.seed, rl.seed).")
OutOpt = typer.Option(None, "--output-dir", "-o", help="Where metrics, checkpoints, models and summary.json go.")


def _config(config: Optional[Path], overrides: Optional[list[str]], seed: Optional[int], output_dir: Optional[str],
            extra: Optional[list[str]] = None, preset: Optional[list[str]] = None):
    from tamer.pipeline import RunConfig, with_seed

    items = list(overrides or []) + list(extra or [])
    if output_dir:
        items.append(f"output_dir={output_dir}")
    cfg = load_config(RunConfig, config, items, preset=preset)
    return with_seed(cfg, seed) if seed is not None else cfg


def _guard(job: Callable[[], Any]) -> Any:
    """Run a job; turn config and data errors into one clear line and exit status 2."""
    try:
        return job()
    except (ConfigError, DatasetError, FileNotFoundError, VLLMEngineError) as err:
        console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
        raise typer.Exit(2) from None


def _table(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title)
    table.add_column("model")
    table.add_column("held-out accuracy", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def _agent_table(summary: dict) -> None:
    table = Table(title=f"{summary['task']}: {summary['heldout_size']} held-out tasks")
    for column in ("agent", "success rate", "tool calls", "cost / optimal", "error rate"):
        table.add_column(column, justify="left" if column == "agent" else "right")
    for name, key in (("demonstrator", "demonstrator"), ("SFT", "sft"), (f"GRPO ({summary['rl_steps']} steps)", "rl")):
        m = summary[key]
        table.add_row(name, *(f"{m[k]:.3f}" if m[k] is not None else "-" for k in
                              ("success_rate", "mean_tool_calls", "mean_cost_ratio", "error_rate")))
    console.print(table)


@app.command()
def demo(config: Optional[Path] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
         env: str = typer.Option("arithmetic", "--env", "-e", help="Built-in task to demo: arithmetic, calculator, trip_planner."),
         seed: Optional[int] = SeedOpt, output_dir: Optional[str] = OutOpt) -> None:
    """Build a tiny model, SFT it on the demonstrator, improve it with GRPO, compare on held-out tasks.

    Writes OUTPUT_DIR/summary.json (demonstrator, SFT and RL figures, rl_steps, seconds) and
    OUTPUT_DIR/reward_accuracy.png. Default OUTPUT_DIR: runs/demo (runs/demo-ENV for tool tasks).
    """
    from tamer.pipeline import DEMO_PRESETS, run_demo

    if env not in DEMO_PRESETS:
        console.print(f"[bold red]error:[/] --env: unknown {env!r}; valid: {', '.join(DEMO_PRESETS)}", soft_wrap=True)
        raise typer.Exit(2)
    cfg = _guard(lambda: _config(config, set_, seed, output_dir, preset=DEMO_PRESETS[env]))
    summary = _guard(lambda: run_demo(cfg))
    if "demonstrator" in summary:
        _agent_table(summary)
        console.print(f"total {summary['seconds']:.0f} s; summary: {Path(cfg.output_dir) / 'summary.json'}")
        return
    _table(f"{summary['task']}: held-out accuracy ({summary['heldout_size']} tasks)", [
        ("demonstrator", f"{summary['demonstrator_accuracy']:.3f}"),
        ("SFT", f"{summary['sft_accuracy']:.3f}"),
        (f"GRPO ({summary['rl_steps']} steps)", f"{summary['rl_accuracy']:.3f}"),
    ])
    console.print(f"total {summary['seconds']:.0f} s; summary: {Path(cfg.output_dir) / 'summary.json'}; plot: {summary['plot']}")


@app.command()
def sft(config: Optional[Path] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
        seed: Optional[int] = SeedOpt, output_dir: Optional[str] = OutOpt) -> None:
    """Supervised fine-tuning on the task's demonstrations; saves OUTPUT_DIR/sft/model."""
    cfg = _guard(lambda: _config(config, set_, seed, output_dir))
    from tamer.pipeline import run_sft

    result = _guard(lambda: run_sft(cfg))
    console.print(f"SFT held-out accuracy {result['sft_accuracy']:.3f}; model saved to {result['model_path']}")


@app.command()
def train(config: Optional[Path] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
          model: Optional[str] = typer.Option(None, "--model", "-m", help="Local Hugging Face model directory to start from (sets model.path)."),
          resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in OUTPUT_DIR/rl/checkpoints."),
          seed: Optional[int] = SeedOpt, output_dir: Optional[str] = OutOpt) -> None:
    """RL with GRPO or a variant (rl.algorithm.*) against the reward functions; saves OUTPUT_DIR/rl/model."""
    cfg = _guard(lambda: _config(config, set_, seed, output_dir, [f"model.path={model}"] if model else None))
    from tamer.pipeline import run_rl

    result = _guard(lambda: run_rl(cfg, resume=resume))
    console.print(f"RL held-out accuracy {result['rl_accuracy']:.3f} after {result['rl_steps']} steps; "
                  f"model saved to {result['model_path']}")


@app.command("eval")
def eval_(model: str = typer.Option(..., "--model", "-m", help="Local Hugging Face model directory to evaluate."),
          config: Optional[Path] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
          as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table.")) -> None:
    """Held-out evaluation: greedy accuracy, mean completion length, pass@k (eval.pass_k)."""
    cfg = _guard(lambda: _config(config, set_, None, None, [f"model.path={model}"]))
    from tamer.pipeline import run_eval

    result = _guard(lambda: run_eval(cfg))
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"{cfg.task.name}: {result['num_tasks']} held-out tasks")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)


config_app = typer.Typer(help="Inspect run configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(config: Optional[Path] = ConfigOpt, set_: Optional[list[str]] = SetOpt) -> None:
    """Print the full resolved config as YAML (defaults + FILE + overrides), checked."""
    cfg = _guard(lambda: _config(config, set_, None, None))
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _mount_subcommands() -> None:
    from tamer.advise import advise_command
    from tamer.compare import compare_command
    from tamer.tools.sandbox_cli import sandbox_app

    app.command("compare")(compare_command)
    app.command("advise")(advise_command)
    app.add_typer(sandbox_app, name="sandbox")


_mount_subcommands()


def main() -> None:
    app(prog_name="tamer")


if __name__ == "__main__":
    sys.exit(main())
