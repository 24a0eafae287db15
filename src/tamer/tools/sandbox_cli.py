"""`tamer sandbox ...`: run a Python file in the sandbox and print the result as one JSON object.

    tamer sandbox run solution.py --timeout 5 --memory-mb 256
    tamer sandbox check          # which protections this machine puts in force

The main CLI mounts this with `app.add_typer(sandbox_app, name="sandbox")`. The exit status is 0
whenever the sandbox itself worked, whatever the program did (read `ok`, `exit_code`, `limit_hit`
in the JSON); 2 for a bad invocation such as a missing file; 1 when the sandbox could not run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NoReturn

import typer

from tamer.tools.sandbox import NETWORK_MODES, SandboxConfig, SandboxError, run_file, run_python

sandbox_app = typer.Typer(help="Run untrusted Python in a locked-down process.", no_args_is_help=True)

_DEFAULTS = SandboxConfig()


@sandbox_app.callback()
def _group() -> None:
    """Run untrusted Python in a locked-down process (see docs/sandbox.md)."""
    # A callback keeps this a command group even while it has few commands, so that
    # `tamer sandbox run FILE` parses the same way here and when mounted in the main app.


@sandbox_app.command("run")
def run_command(
    file: Path = typer.Argument(..., help="Python file to run (copied into the sandbox as main.py)."),
    timeout: float = typer.Option(_DEFAULTS.timeout_s, "--timeout", help="Wall-clock limit, seconds."),
    memory_mb: int = typer.Option(_DEFAULTS.memory_mb, "--memory-mb", help="Address-space limit, MiB."),
    network: str = typer.Option(_DEFAULTS.network, "--network", help="isolate | allow"),
    stdin_file: Path = typer.Option(None, "--stdin", help="File whose content is the program's stdin."),
) -> None:
    """Run FILE and print the result as one JSON object."""
    if not file.is_file():
        _usage_error(f"no such file: {file}")
    if network not in NETWORK_MODES:
        _usage_error(f"--network must be one of {', '.join(NETWORK_MODES)}, got {network!r}")
    if stdin_file is not None and not stdin_file.is_file():
        _usage_error(f"no such file: {stdin_file}")
    try:
        config = dataclasses.replace(_DEFAULTS, timeout_s=timeout, memory_mb=memory_mb, network=network)
    except ValueError as exc:
        _usage_error(str(exc))
    stdin = stdin_file.read_text(encoding="utf-8") if stdin_file is not None else ""
    try:
        result = run_file(file, config, stdin=stdin)
    except SandboxError as exc:
        typer.echo(f"error: sandbox failed: {exc}", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps(result.to_dict()))


@sandbox_app.command("check")
def check_command() -> None:
    """Run a trivial program and print which protections are in force here (JSON)."""
    try:
        result = run_python("print('ok')", SandboxConfig(timeout_s=10))
    except SandboxError as exc:
        typer.echo(f"error: sandbox failed: {exc}", err=True)
        raise typer.Exit(1)
    payload = {"ok": result.ok, "protections": list(result.protections), "warnings": list(result.warnings)}
    typer.echo(json.dumps(payload))


def _usage_error(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
