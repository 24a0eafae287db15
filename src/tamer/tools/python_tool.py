"""The `python` tool: the agent runs a Python program in the sandbox and reads what it printed.

    tool = make_python_tool(SandboxConfig(timeout_s=3.0))
    tools = ToolSet([tool])
    tool.function(code="print(6 * 7)")                    # "42"
    tool.function(code="1/0")
    # "Traceback (most recent call last): ... ZeroDivisionError: division by zero\n[exit status 1]"

Each call is stateless: a fresh process and working directory, nothing kept between calls
(variables, files, imports), so the model has to print what it wants to see. The observation
is compact text: stdout, and when the run did not succeed, the tail of stderr (where the
traceback ends) and one status line: `[exit status N]`, `[killed: timeout limit]`,
`[killed by signal N]`. It is cut to `max_chars`, and the function never raises: a sandbox
that cannot start is reported as text too, so one bad call cannot end an episode.

The environment that offers this tool to agents is `python` in tamer/tasks/code.py (it lives
with the tasks, since environments import tools and not the other way round).
"""

from __future__ import annotations

import re

from tamer.tools.sandbox import SandboxConfig, SandboxResult, run_python
from tamer.tools.schema import Tool

# Short: an agent's probe should answer in seconds, and this deadline must fall inside the
# tool executor's own (`ToolEnvConfig.tool_timeout_s`, 5 s by default), so that the agent sees
# what the program printed before it was killed rather than a bare "tool timed out".
TOOL_SANDBOX = SandboxConfig(timeout_s=3.0, max_output_bytes=16 * 1024)
NO_OUTPUT = "(no output; print() what you want to see)"
# Tracebacks name the run's random workdir (/tmp/tamer-sbx-k3j9/main.py): noise to the model.
_WORKDIR_RE = re.compile(r'(?<=")[^"]*/tamer-sbx-[^/"]+/')


def make_python_tool(config: SandboxConfig = TOOL_SANDBOX, max_chars: int = 2000) -> Tool:
    """A `python(code)` tool that runs each call in a fresh sandbox with `config`."""
    if max_chars < 100:
        raise ValueError(f"max_chars: expected at least 100, got {max_chars}")

    def python(code: str) -> str:
        """Run a Python program in a fresh sandbox and return what it printed. Nothing is kept between calls.

        Args:
            code: A complete Python program; print() the values you want to see.
        """
        try:
            result = run_python(code, config)
        except Exception as exc:
            return f"error: the sandbox could not run the code ({type(exc).__name__}: {exc})"[:max_chars]
        return format_result(result, max_chars)

    return Tool.from_function(python)


def format_result(result: SandboxResult, max_chars: int = 2000) -> str:
    """stdout (head), then, unless the run succeeded, the stderr tail and a status line."""
    if result.ok:
        return _head(result.stdout.rstrip("\n"), result.stdout_truncated, max_chars) or NO_OUTPUT
    status = _status(result)
    # Half the budget at most for stderr: a traceback's last lines say what went wrong.
    stderr_budget = max(0, min(max_chars // 2, max_chars - len(status) - 1))
    stderr = _tail(_WORKDIR_RE.sub("", result.stderr).rstrip("\n"), stderr_budget)
    budget = max_chars - len(status) - len(stderr) - 2
    stdout = _head(result.stdout.rstrip("\n"), result.stdout_truncated, budget)
    return "\n".join(part for part in (stdout, stderr, status) if part)


def _status(result: SandboxResult) -> str:
    if result.limit_hit is not None:
        return f"[killed: {result.limit_hit} limit]"
    if result.signal is not None:
        return f"[killed by signal {result.signal}]"
    return f"[exit status {result.exit_code}]"


def _head(text: str, truncated: bool, budget: int) -> str:
    marker = "\n...[output truncated]"
    if len(text) <= budget and not truncated:
        return text
    if budget <= len(marker):
        return ""
    return text[: budget - len(marker)] + marker


def _tail(text: str, budget: int) -> str:
    marker = "...[truncated]\n"
    if len(text) <= budget:
        return text
    if budget <= len(marker):
        return ""
    return marker + text[len(text) - budget + len(marker):]
