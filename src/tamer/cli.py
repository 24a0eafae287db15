"""The `tamer` command line: every command lives here; the work is done by library functions.

    tamer demo [--env calculator]        tiny model -> SFT -> GRPO -> held-out table
    tamer sft | train | eval             one phase of a run
    tamer rm                             a Bradley–Terry reward model from preference pairs
    tamer compare | advise               GRPO vs PPO side by side; does my agent need RL, and which
    tamer view RUN_DIR                   a self-contained HTML page of a run's rollouts and curves
    tamer export [--merge] MODEL -o OUT  a LoRA run's model merged into a standard HF model, or base + adapter
    tamer plan [--memory-gb 24]          the peak memory of an RL step per device, and what fits
    tamer config show | list             the resolved config with each field's help; the presets
    tamer sandbox run | check            untrusted Python in a locked-down process

Every run command loads its config one way (`tamer.config.load_config`): the defaults, then
`--config` files or presets in order, then `--set section.field=value` overrides, then
`--seed`; `--import MODULE` first registers your own tasks, environments and rewards. The whole
config is checked before any work starts; a bad value is one line naming its field (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tamer.advise import AdviseConfig, run_advise
from tamer.compare import run_compare
from tamer.config import ConfigError, describe, from_dict, load_config
from tamer.errors import RunError
from tamer.export import export_model
from tamer.phases import PhaseError
from tamer.pipeline import RunConfig, run_demo, run_eval, run_rl, run_sft, seed_overrides, write_json
from tamer.plan import CPU_RUNTIME_MB, plan_run, what_fits
from tamer.preference_demo import print_summary as print_preference_summary
from tamer.preference_demo import run_preference_demo
from tamer.presets import config_file, describe_preset, preset_names, preset_path
from tamer.progress import ProgressView
from tamer.rlhf import calibration_table, run_rm
from tamer.rollout.vllm.errors import VLLMEngineError
from tamer.stopping import TrainingStopped
from tamer.tasks.dataset import DatasetError
from tamer.tools.sandbox import NETWORK_MODES, SandboxConfig, SandboxError, run_file, run_python
from tamer.transcripts import print_episodes
from tamer.viewer import ViewError, make_server, write_page

app = typer.Typer(
    help="tamer: train LLM agents with reinforcement learning from verifiable feedback.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)  # warnings: stdout stays the result (--json)

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML file (RunConfig sections) or a preset name "
                         "(`tamer config list`); repeatable, later files win.")
SetOpt = typer.Option(None, "--set", "-s", help="Override one field, e.g. --set rl.steps=50 --set rl.optim.lr=1e-5; "
                      "a mapping given whole replaces the default one (repeatable).")
ImportOpt = typer.Option(None, "--import", help="Module or .py file imported first: registers your tasks, "
                         "environments and rewards (repeatable; also the `plugins:` config key).")
SeedOpt = typer.Option(None, "--seed", help="Seed for model init, data order and sampling (sets model.tiny.seed, "
                       "sft.seed, rl.seed).")
OutOpt = typer.Option(None, "--output-dir", "-o", help="Where metrics, checkpoints, models and summary.json go.")
ModelOpt = typer.Option(None, "--model", "-m", help="Local Hugging Face model directory (sets model.path).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of a table.")
ResumeIfExistsOpt = typer.Option(False, "--resume-if-exists", help="Resume when a checkpoint exists, else start fresh.")


def _resume_opt(phase: str):
    """The --resume option of a command that checkpoints into OUTPUT_DIR/PHASE/checkpoints."""
    return typer.Option(False, "--resume", help=f"Continue from the latest checkpoint in OUTPUT_DIR/{phase}/"
                        "checkpoints.")


# ---------------------------------------------------------------------------- shared plumbing
def load_run_config(files: Optional[list[str]] = None, overrides: Optional[list[str]] = None,
                    imports: Optional[list[str]] = None, *, seed: Optional[int] = None,
                    output_dir: Optional[str] = None, model: Optional[str] = None,
                    preset: Optional[str] = None) -> RunConfig:
    """The run config every command loads: preset < files < --set < --model/--output-dir < --seed."""
    paths = ([preset_path(preset)] if preset else []) + [config_file(f) for f in files or []]
    items = list(overrides or [])
    items += [f"model.path={model}"] if model else []
    items += [f"output_dir={output_dir}"] if output_dir else []
    items += seed_overrides(seed) if seed is not None else []
    return load_config(RunConfig, paths, items, plugins=imports or ())


def _guard(job: Callable[[], Any]) -> Any:
    """Run a job; config, data, disk, lock and model-directory errors become one red line and exit 2,
    a failed phase exit 1; a run stopped by SIGTERM/SIGINT prints one line and exits 128 + signal."""
    try:
        return job()
    except (ConfigError, DatasetError, FileNotFoundError, RunError, VLLMEngineError) as err:
        _fail(str(err), 2)
    except PhaseError as err:
        _fail(str(err), 1)
    except TrainingStopped as stop:
        console.print(stop.message(), soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(stop.exit_code) from None


def _fail(message: str, code: int) -> NoReturn:
    # escape: text such as 'pip install "tamer[wandb]"' is not Rich markup
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", soft_wrap=True, highlight=False)


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _fmt(value: Any) -> str:
    """A table cell: "-" for a missing figure (None, or NaN: e.g. a cost ratio of a task without costs)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------- run commands
@app.command()
def demo(config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
         env: str = typer.Option("arithmetic", "--env", "-e", help="Built-in task to demo (preset demo-ENV): "
                                 "arithmetic, calculator, trip_planner, preference (RLHF)."),
         imports: Optional[list[str]] = ImportOpt, seed: Optional[int] = SeedOpt,
         output_dir: Optional[str] = OutOpt,
         resume: bool = typer.Option(False, "--resume", help="Continue a stopped demo: finished phases are reused, "
                                     "a stopped one resumes from its checkpoint.")) -> None:
    """Build a tiny model, SFT it on the demonstrator, improve it with GRPO, compare on held-out tasks.

    Writes OUTPUT_DIR/summary.json (demonstrator, SFT and RL figures, rl_steps, seconds) and
    OUTPUT_DIR/reward_accuracy.png. Default OUTPUT_DIR: runs/demo (runs/demo-ENV for tool tasks).
    """
    if f"demo-{env}" not in preset_names():
        demos = [n.removeprefix("demo-") for n in preset_names() if n.startswith("demo-")]
        _fail(f"--env: unknown {env!r}; valid: {', '.join(demos)}", 2)
    cfg = _guard(lambda: load_run_config(config, set_, imports, seed=seed, output_dir=output_dir, preset=f"demo-{env}"))
    if env == "preference":  # RLHF: SFT -> reward model from preferences -> GRPO and PPO against it
        print_preference_summary(_guard(lambda: run_preference_demo(cfg)), console)
        return
    summary = _guard(lambda: run_demo(cfg, resume=resume))
    if "demonstrator" in summary:
        keys = ("success_rate", "mean_tool_calls", "mean_cost_ratio", "error_rate")
        rows = [[name, *(_fmt(summary[key][k]) for k in keys)] for name, key in
                (("demonstrator", "demonstrator"), ("SFT", "sft"), (f"GRPO ({summary['rl_steps']} steps)", "rl"))]
        _table(f"{summary['task']}: {summary['heldout_size']} held-out tasks",
               ["agent", "success rate", "tool calls", "cost / optimal", "error rate"], rows)
    else:
        _table(f"{summary['task']}: held-out accuracy ({summary['heldout_size']} tasks)",
               ["model", "held-out accuracy"],
               [["demonstrator", _fmt(summary["demonstrator_accuracy"])], ["SFT", _fmt(summary["sft_accuracy"])],
                [f"GRPO ({summary['rl_steps']} steps)", _fmt(summary["rl_accuracy"])]])
    console.print(f"total {summary['seconds']:.0f} s; summary: {Path(cfg.output_dir) / 'summary.json'}; "
                  f"plot: {summary['plot']}")


@app.command()
def sft(config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
        imports: Optional[list[str]] = ImportOpt, seed: Optional[int] = SeedOpt,
        output_dir: Optional[str] = OutOpt,
        resume: bool = _resume_opt("sft"),
        resume_if_exists: bool = ResumeIfExistsOpt) -> None:
    """Supervised fine-tuning on the task's demonstrations; saves OUTPUT_DIR/sft/model.

    SIGTERM or Ctrl-C: stops after the current step with a checkpoint, exit status 143 or 130;
    run again with --resume to continue (docs/robustness.md)."""
    cfg = _guard(lambda: load_run_config(config, set_, imports, seed=seed, output_dir=output_dir))
    result = _guard(lambda: run_sft(cfg, resume="if-exists" if resume_if_exists else resume))
    console.print(f"SFT held-out accuracy {result['sft_accuracy']:.3f}; model saved to {result['model_path']}")


@app.command()
def train(config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
          model: Optional[str] = ModelOpt, imports: Optional[list[str]] = ImportOpt,
          resume: bool = _resume_opt("rl"),
          resume_if_exists: bool = ResumeIfExistsOpt,
          seed: Optional[int] = SeedOpt, output_dir: Optional[str] = OutOpt) -> None:
    """RL with GRPO, a variant or PPO (rl.algorithm.*) against the reward functions; saves OUTPUT_DIR/rl/model.

    SIGTERM or Ctrl-C: stops after the current step with a checkpoint, exit status 143 or 130;
    run again with --resume to continue (docs/robustness.md)."""
    cfg = _guard(lambda: load_run_config(config, set_, imports, seed=seed, output_dir=output_dir, model=model))
    if not cfg.model.path:
        _warn("RL starts from an untrained model (no --model or model.path: a randomly initialised model.tiny); "
              "start from an SFT model, e.g. --model OUTPUT_DIR/sft/model")
    result = _guard(lambda: run_rl(cfg, resume="if-exists" if resume_if_exists else resume))
    console.print(f"RL held-out accuracy {result['rl_accuracy']:.3f} after {result['rl_steps']} steps; "
                  f"model saved to {result['model_path']}")


@app.command("eval")
def eval_(model: str = typer.Option(..., "--model", "-m", help="Local Hugging Face model directory to evaluate."),
          config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
          imports: Optional[list[str]] = ImportOpt, as_json: bool = JsonOpt,
          show: int = typer.Option(0, "--show", min=0, help="Also print N held-out episodes: turns, tool calls, "
                                   "results, reward breakdown.")) -> None:
    """Held-out evaluation: greedy accuracy, mean completion length, pass@k (eval.pass_k)."""
    cfg = _guard(lambda: load_run_config(config, set_, imports, model=model))
    if not config and not any(item.startswith("task.") for item in set_ or []):
        _warn(f"no --config: evaluating on the default task {cfg.task.name!r}")
    with ProgressView(Console(stderr=True), "held-out", None):  # a bar on a terminal; stdout stays the result
        result = _guard(lambda: run_eval(cfg, show=show))
    if as_json:
        print(json.dumps(result))
        return
    print_episodes(console, result.pop("episodes", []))
    rows = [[key, f"{value:.4g}" if isinstance(value, float) else str(value)] for key, value in result.items()]
    _table(f"{cfg.task.name}: {result['num_tasks']} held-out tasks", ["metric", "value"], rows)


@app.command()
def rm(config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
       data: Optional[str] = typer.Option(None, "--data", "-d", help="Preference file, .jsonl/.json/.parquet "
                                          "(sets rm.data.path)."),
       model: Optional[str] = typer.Option(None, "--model", "-m", help="Local HF model to start from, usually the "
                                           "SFT model (sets rm.base_model)."),
       imports: Optional[list[str]] = ImportOpt,
       seed: Optional[int] = typer.Option(None, "--seed", help="Seed for init and data order (sets rm.seed)."),
       output_dir: Optional[str] = OutOpt) -> None:
    """Train a Bradley–Terry reward model on preference pairs (prompt, chosen, rejected[, margin]).

    Saves OUTPUT_DIR/rm/model (a Hugging Face sequence-classification model with its tokenizer) and
    prints held-out pairwise accuracy and calibration. Use it as a reward with
    reward.weights={reward_model: 1.0} and reward.params={reward_model: {path: OUTPUT_DIR/rm/model}}.
    """
    extra = [f"rm.data.path={data}"] * bool(data) + [f"rm.base_model={model}"] * bool(model)
    extra += [f"rm.seed={seed}"] * (seed is not None)
    cfg = _guard(lambda: load_run_config(config, [*(set_ or []), *extra], imports, output_dir=output_dir))
    result = _guard(lambda: run_rm(cfg))
    console.print(calibration_table(result["calibration_report"],
                                    f"reward model: {result['heldout_pairs']} held-out pairs"))
    console.print(f"held-out pairwise accuracy {result['rm_accuracy']:.3f}, ECE {result['rm_ece']:.3f}; "
                  f"{result['rm_seconds']:.0f} s; model saved to {result['model_path']}")


@app.command()
def compare(config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
            imports: Optional[list[str]] = ImportOpt, seed: Optional[int] = SeedOpt,
            output_dir: Optional[str] = OutOpt,
            sft_model: Optional[str] = typer.Option(None, "--sft-model", help="Start both RL methods from this saved "
                                                    "SFT model instead of running SFT."),
            as_json: bool = JsonOpt,
            quiet: bool = typer.Option(False, "--quiet", "-q", help="Hide the phases' own progress lines.")) -> None:
    """SFT, then PPO and GRPO from the same SFT model with the same budget; compare them.

    Reports per method held-out accuracy, wall-clock seconds, peak resident memory (measured,
    each phase in its own process), models held, trainable parameters and the reward curve.
    Writes OUTPUT_DIR/summary.json and OUTPUT_DIR/compare.png. Starts from the preset `compare`
    (a 35.6M-parameter model, 300 SFT steps; `tamer config show -c compare`).
    """
    cfg = _guard(lambda: load_run_config(config, set_, imports, seed=seed, output_dir=output_dir, preset="compare"))
    if sft_model and not (Path(sft_model) / "config.json").is_file():
        _fail(f"--sft-model {sft_model}: not a saved model directory (no config.json)", 2)
    summary = _guard(lambda: run_compare(cfg, sft_model=sft_model, quiet=quiet or as_json))
    if as_json:
        print(json.dumps(summary, default=str))
        return
    _compare_table(summary)
    console.print(f"summary: {Path(cfg.output_dir) / 'summary.json'}; plot: {summary['plot']}")


def _compare_table(summary: dict[str, Any]) -> None:
    budget = summary["budget"]
    rows = []
    for row in summary["rows"].values():
        curve = row.get("reward_curve") or []
        rewards = f"{curve[0][1]:.3f} -> {curve[-1][1]:.3f}" if curve else "-"
        rows.append([row["method"], _fmt(row["heldout_accuracy"]), f"{row['seconds']:.0f}", f"{row['peak_rss_mb']:.0f}",
                     str(row["models_held"]), f"{row['trainable_parameters']:,}", rewards])
    _table(f"{summary['task']}: SFT, then {budget['rl_steps']} RL steps x {budget['prompts_per_step']} prompts x "
           f"{budget['group_size']} samples each", ["method", "held-out acc", "seconds", "peak RSS MB", "models held",
                                                    "trainable params", "reward first -> last"], rows)
    console.print(f"GRPO peak RSS / PPO peak RSS = {summary['grpo_over_ppo_peak_rss']:.2f} (each in its own process; "
                  f"Python + torch alone: {summary['rows']['sft']['baseline_rss_mb']:.0f} MB)")


@app.command()
def advise(
    config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt, model: Optional[str] = ModelOpt,
    imports: Optional[list[str]] = ImportOpt,
    k: int = typer.Option(8, "--k", help="k of pass@k."),
    tasks: int = typer.Option(32, "--tasks", help="Held-out tasks for pass@1 and pass@k."),
    prompts: int = typer.Option(16, "--prompts", help="Training prompts for the reward-spread round."),
    group_size: int = typer.Option(0, "--group-size", help="Samples per prompt for the spread (0: rl.group_size)."),
    memory_gb: Optional[float] = typer.Option(None, "--memory-gb", help="Memory budget for training, in GB "
                                              "(decides GRPO vs PPO)."),
    step_measure: bool = typer.Option(True, "--step-measure/--no-step-measure", help="Time GRPO and PPO steps "
                                      "(each in its own process)."),
    steps: int = typer.Option(2, "--steps", help="RL steps timed per method; the first is a warm-up when > 1."),
    seed: Optional[int] = SeedOpt, as_json: bool = JsonOpt,
    save: Optional[Path] = typer.Option(None, "--save", help="Also write the advice as JSON to this file."),
) -> None:
    """Does my agent need RL, and which kind? Measures, then recommends with the numbers.

    Measures data size, pass@1 and pass@k, the fraction of zero-spread reward groups, reward-function
    health (errors, constant outputs) and the time and memory of GRPO and PPO steps; then
    recommends: RL not needed, SFT first, fix the reward, get more data, GRPO or PPO.
    """
    cfg = _guard(lambda: load_run_config(config, set_, imports, seed=seed, model=model))
    options = _guard(lambda: from_dict(AdviseConfig, dict(
        k=k, eval_tasks=tasks, spread_prompts=prompts, group_size=group_size, memory_gb=memory_gb,
        measure_steps=steps if step_measure else 0), "advise"))
    advice = _guard(lambda: run_advise(cfg, options))
    if save is not None:
        write_json(save, advice.to_dict())
    if as_json:
        print(json.dumps(advice.to_dict(), default=str))
    else:
        typer.echo(advice.text())


@app.command()
def view(
    run_dir: Path = typer.Argument(..., help="A run's output directory (e.g. runs/demo) or one phase of it "
                                   "(runs/demo/rl)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write the page "
                                          "(default RUN_DIR/view.html)."),
    serve: bool = typer.Option(False, "--serve", help="Also serve the page on http://127.0.0.1:PORT/ until Ctrl-C."),
    port: int = typer.Option(8765, "--port", help="Port for --serve (127.0.0.1 only)."),
) -> None:
    """Write a self-contained HTML page of a run's rollouts and curves (no network needed to open it)."""
    try:
        page = write_page(run_dir, output)
    except (ViewError, ValueError, OSError) as err:
        _fail(str(err), 2)
    console.print(f"wrote {page} ({page.stat().st_size / 1024:.0f} KiB); open it in a browser", soft_wrap=True)
    if not serve:
        return
    try:
        server = make_server(page, port)
    except OSError as err:
        _fail(f"--port {port}: {err.strerror or err}", 2)
    console.print(f"serving http://127.0.0.1:{server.server_address[1]}/{page.name} (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@app.command()
def plan(config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt, model: Optional[str] = ModelOpt,
         imports: Optional[list[str]] = ImportOpt,
         memory_gb: float = typer.Option(24.0, "--memory-gb", help="Memory of one device, GB: what fits in it."),
         prompt_tokens: int = typer.Option(0, "--prompt-tokens", min=0, help="Longest prompt in tokens "
                                           "(0: measured on the task's first 64 training prompts)."),
         runtime_mb: float = typer.Option(CPU_RUNTIME_MB, "--runtime-mb", help="The process before any model: "
                                          "Python, torch, transformers (CPU) or a CUDA context."),
         as_json: bool = JsonOpt) -> None:
    """Estimate the peak memory of one RL step of this config per device, and what fits in --memory-gb.

    Counts the weights, the reference (none with LoRA: the same model with adapters off), the
    critic, gradients, AdamW, the learner's activations for one micro-batch and the sampler's KV
    cache (docs/memory_plan.md). Nothing is loaded: a model.path is read from its config.json."""
    cfg = _guard(lambda: load_run_config(config, set_, imports, model=model))
    shape, setup, estimate = _guard(lambda: plan_run(cfg, prompt_tokens, runtime_mb))
    options = what_fits(shape, setup, memory_gb)
    if as_json:
        print(json.dumps({"memory_gb": memory_gb, "shape": dataclasses.asdict(shape),
                          "setup": dataclasses.asdict(setup), "estimate": estimate.to_dict(), "options": options}))
        return
    rows = [[name, f"{value:,.0f}"] for name, value in estimate.components.items()]
    rows += [[f"{estimate.phase} peak (transient)", f"{max(estimate.learner_mb, estimate.sampler_mb):,.0f}"],
             ["total", f"{estimate.peak_mb:,.0f}"]]
    _table(f"{estimate.parameters:,} parameters, {estimate.trainable:,} trained; {setup.prompts}x{setup.group_size} "
           f"samples of {setup.prompt_tokens}+{setup.completion_tokens} tokens", ["part", "MB"], rows)
    _table(f"one device with {memory_gb:g} GB", ["option", "peak MB", "fits"],
           [[o["option"], f"{o['peak_mb']:,.0f}", "yes" if o["fits"] else "no"] for o in options])


@app.command()
def export(
    source: Path = typer.Argument(..., help="A model directory: a run's OUTPUT_DIR/rl/model (LoRA or full) or any."),
    output: Path = typer.Option(..., "--output", "-o", help="Directory to write."),
    merge: bool = typer.Option(False, "--merge", help="Merge a LoRA adapter into its base: a standard Hugging Face "
                               "model (AutoModelForCausalLM loads it alone). Without: OUTPUT/base + OUTPUT/adapter."),
) -> None:
    """Export a trained model: merged into a standard HF model, or as a base and a peft adapter (e.g. for vLLM)."""
    path = _guard(lambda: export_model(source, output, merge=merge))
    console.print(f"wrote {path}" + ("" if merge else f" (base: {path / 'base'}, adapter: {path / 'adapter'})"),
                  soft_wrap=True, highlight=False)


# ---------------------------------------------------------------------------- config
config_app = typer.Typer(help="Inspect run configs and presets.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(config: Optional[list[str]] = ConfigOpt, set_: Optional[list[str]] = SetOpt,
                imports: Optional[list[str]] = ImportOpt) -> None:
    """Print the full resolved config as YAML, each field with its one-line help (checked)."""
    cfg = _guard(lambda: load_run_config(config, set_, imports))
    print("\n".join(describe(cfg)))


@config_app.command("list")
def config_list() -> None:
    """List the presets (usable as --config NAME or --config configs/NAME.yaml)."""
    _table("presets", ["name", "what it is for", "file"],
           [[name, describe_preset(name), str(preset_path(name))] for name in preset_names()])


# ---------------------------------------------------------------------------- sandbox
sandbox_app = typer.Typer(help="Run untrusted Python in a locked-down process (docs/sandbox.md).",
                          no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
_SANDBOX = SandboxConfig()


@sandbox_app.command("run")
def sandbox_run(
    file: Path = typer.Argument(..., help="Python file to run (copied into the sandbox as main.py)."),
    timeout: float = typer.Option(_SANDBOX.timeout_s, "--timeout", help="Wall-clock limit, seconds."),
    memory_mb: int = typer.Option(_SANDBOX.memory_mb, "--memory-mb", help="Address-space limit, MiB."),
    network: str = typer.Option(_SANDBOX.network, "--network", help="isolate | allow"),
    stdin_file: Path = typer.Option(None, "--stdin", help="File whose content is the program's stdin."),
) -> None:
    """Run FILE and print the result as one JSON object.

    Exit status 0 whenever the sandbox itself worked, whatever the program did (read `ok`,
    `exit_code`, `limit_hit` in the JSON); 2 for a bad invocation; 1 when the sandbox could not run.
    """
    if not file.is_file():
        _sandbox_usage(f"no such file: {file}")
    if network not in NETWORK_MODES:
        _sandbox_usage(f"--network must be one of {', '.join(NETWORK_MODES)}, got {network!r}")
    if stdin_file is not None and not stdin_file.is_file():
        _sandbox_usage(f"no such file: {stdin_file}")
    try:
        config = dataclasses.replace(_SANDBOX, timeout_s=timeout, memory_mb=memory_mb, network=network)
    except ValueError as exc:
        _sandbox_usage(str(exc))
    stdin = stdin_file.read_text(encoding="utf-8") if stdin_file is not None else ""
    try:
        result = run_file(file, config, stdin=stdin)
    except SandboxError as exc:
        typer.echo(f"error: sandbox failed: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(result.to_dict()))


@sandbox_app.command("check")
def sandbox_check() -> None:
    """Run a trivial program and print which protections are in force here (JSON)."""
    try:
        result = run_python("print('ok')", SandboxConfig(timeout_s=10))
    except SandboxError as exc:
        typer.echo(f"error: sandbox failed: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({"ok": result.ok, "protections": list(result.protections),
                           "warnings": list(result.warnings)}))


def _sandbox_usage(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def main() -> None:
    app(prog_name="tamer")


if __name__ == "__main__":
    sys.exit(main())
