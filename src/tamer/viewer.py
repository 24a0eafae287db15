"""`tamer view RUN_DIR`: one self-contained HTML page to read a run's rollouts and curves.

    tamer demo && tamer view runs/demo            # writes runs/demo/view.html
    tamer view runs/demo --serve --port 8765      # and serves it on http://127.0.0.1:8765/

    path = write_page("runs/demo")                # from Python; page_data() is the embedded JSON

The page needs no network: its script, style and data are inline (no CDN, no fetch), so it
opens from disk, from a CI artifact or from a mail attachment. It reads:

    RUN_DIR/{sft,rl}/rollouts.jsonl saved rollouts (tamer.rollout_log), or RUN_DIR/rollouts.jsonl
    RUN_DIR/{sft,rl}/metrics.jsonl  the curves
    RUN_DIR/summary.json, RUN_DIR/sft/summary.json   demonstrator and SFT levels (baselines)

Rollouts tab: per step, the saved groups side by side (sorted by mean reward), each group's
attempts sorted by reward; an attempt opens to its turns, tool calls and results, its tokens
(trained ones highlighted, masked ones grey) and its reward breakdown. Filters: kind (train,
eval), step, reward range, errors only, truncated only, text. Curves tab: every metric of
metrics.jsonl against step, the baselines as dashed lines, and the health warnings raised.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from tamer.rollout_log import ROLLOUTS_FILE, read_rollouts, strict_json
from tamer.tracking import METRICS_FILE, read_baselines, read_metrics

PAGE_FILE = "view.html"
PHASES = ("sft", "rl")


class ViewError(ValueError):
    """RUN_DIR holds nothing the viewer can show; the message names the directory."""


def locate(run_dir: str | Path) -> tuple[Path, dict[str, Path], list[Path]]:
    """(output dir, phase -> dir holding metrics.jsonl, rollouts.jsonl files) for a run or phase dir."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ViewError(f"{run_dir}: no such directory")
    phases = {p: run_dir / p for p in PHASES if (run_dir / p / METRICS_FILE).is_file()}
    output_dir = run_dir
    if not phases and (run_dir / METRICS_FILE).is_file():  # a phase directory itself (runs/demo/rl)
        phases = {run_dir.name: run_dir}
        output_dir = run_dir.parent if run_dir.name in PHASES else run_dir
    places = dict.fromkeys([*phases.values(), *(run_dir / p for p in PHASES), run_dir])
    rollouts = [d / ROLLOUTS_FILE for d in places if (d / ROLLOUTS_FILE).is_file()]
    if not phases and not rollouts:
        raise ViewError(f"{run_dir}: no metrics.jsonl or rollouts.jsonl here or in {run_dir}/rl, {run_dir}/sft "
                        "(point it at a run's output directory, e.g. runs/demo)")
    return output_dir, phases, rollouts


def _summary(output_dir: Path) -> dict[str, Any]:
    path = output_dir / "summary.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not isinstance(v, (dict, list))}


def page_data(run_dir: str | Path) -> dict[str, Any]:
    """Everything the page shows, as plain JSON data (strict: no NaN)."""
    output_dir, phases, rollout_files = locate(run_dir)
    return strict_json({
        "title": output_dir.resolve().name,
        "run_dir": str(run_dir),
        "metrics": {phase: read_metrics(path) for phase, path in phases.items()},
        "rollouts": [r for path in rollout_files for r in read_rollouts(path)],
        "baselines": read_baselines(output_dir),
        "summary": _summary(output_dir),
    })


def _asset(name: str) -> str:
    return resources.files("tamer").joinpath("viewer_assets", name).read_text(encoding="utf-8")


def render_page(data: dict[str, Any]) -> str:
    """The HTML: style, data and script inline."""
    # "<" as \u003c keeps "</script>" or "<!--" inside a string from closing the data block; still JSON.
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")
    title = str(data.get("title", "run")).replace("&", "&amp;").replace("<", "&lt;")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>tamer view: {title}</title>\n<style>\n{_asset('viewer.css')}</style>\n</head>\n<body>\n"
            f'<script id="tamer-data" type="application/json">{payload}</script>\n'
            f"{_asset('viewer.html')}\n<script>\n{_asset('viewer.js')}</script>\n</body>\n</html>\n")


def write_page(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the page (default RUN_DIR/view.html); returns its path."""
    html = render_page(page_data(run_dir))
    out = Path(out) if out else Path(run_dir) / PAGE_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)
    return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def make_server(page: Path, port: int) -> http.server.ThreadingHTTPServer:
    """A server for the page's directory, bound to 127.0.0.1 only (port 0: any free port)."""
    handler = functools.partial(_QuietHandler, directory=str(page.parent.resolve()))
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


def serve_in_thread(page: Path, port: int = 0) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve in a daemon thread (tests, notebooks); returns the server and the page's URL."""
    server = make_server(page, port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/{page.name}"
