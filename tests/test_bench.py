"""benchmarks/: the TRL settings documented in docs/performance.md are the ones `trl_settings()` sets,
and the statistics of the speed and learning comparisons (hand-computed cases)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_stats as bs  # noqa: E402
from grpo_workers import trl_settings  # noqa: E402

HEADING = "## TRL settings that differ from tamer's behaviour"
SPEED_SPEC = dict(prompts_per_step=4, group_size=8, max_new_tokens=32, lr=1e-5, beta=0.04, precision="fp32",
                  run_dir="/tmp/run", total_steps=14, seed=3, eval_every=0)
LEARNING_SPEC = dict(SPEED_SPEC, lr=1e-4, prompts_per_step=16, beta=0.0, eval_every=5, total_steps=40)


def documented_settings() -> dict[str, str]:
    """field -> the `trl_config()` expression column of the table under HEADING."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert HEADING in text, f"docs/performance.md lacks the section {HEADING!r}"
    rows, in_body = {}, False
    for line in text.split(HEADING, 1)[1].splitlines()[1:]:
        if line.startswith("## "):
            break
        in_body = in_body or line.startswith("|---")
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if in_body and not line.startswith("|---") and len(cells) >= 4:
            rows[cells[0].strip("`")] = cells[1].strip("`")
    assert len(rows) >= 10, rows
    return rows


def _value(expression: str, spec: dict):
    tree = ast.parse(expression, mode="eval")
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert names <= {"spec"}, f"only `spec` may appear in {expression!r}"
    return eval(compile(tree, "<doc>", "eval"), {"__builtins__": {}}, {"spec": spec})


@pytest.mark.parametrize("spec", [SPEED_SPEC, LEARNING_SPEC], ids=["speed", "learning"])
def test_documented_trl_settings_are_set(spec):
    """Each setting listed as differing from tamer is set by trl_settings(), to the documented value."""
    settings = trl_settings(spec)
    for name, expression in documented_settings().items():
        assert name in settings, f"docs/performance.md lists {name}, trl_settings() does not set it"
        assert settings[name] == _value(expression, spec), name
    assert settings["gradient_checkpointing"] is False and settings["use_bias_correction_kl"] is False
    assert (settings["logging_steps"] > settings["max_steps"] if not spec["eval_every"]
            else settings["logging_steps"] == 1)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install -e '.[bench]')")
def test_every_changed_trl_default_is_documented():
    """The other direction: every GRPOConfig default that trl_settings() changes is in the table."""
    from trl import GRPOConfig
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(GRPOConfig)}
    documented = documented_settings()
    changed = {k for k, v in trl_settings(SPEED_SPEC).items() if defaults[k] != v}
    assert changed - set(documented) == set(), "changed but not documented"
    assert set(documented) - changed == set(), "documented as differing but equal to TRL's default"


# ---------------------------------------------------------------------------- statistics
def test_t_distribution_matches_tables():
    assert bs.t_ppf(0.975, 20) == pytest.approx(2.0860, abs=1e-4)  # the t table's 2.086
    assert bs.t_ppf(0.95, 23) == pytest.approx(1.7139, abs=1e-4)
    assert bs.t_cdf(0.0, 7) == pytest.approx(0.5)
    assert bs.t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert bs.t_cdf(-2.0, 2) == pytest.approx(0.5 - 1 / math.sqrt(6), abs=1e-12)  # closed form for df = 2
    assert bs.binom_two_sided(0, 5) == pytest.approx(2 / 32)
    assert bs.binom_two_sided(3, 6) == pytest.approx(1.0)
    assert bs.binom_two_sided(1, 6) == pytest.approx(14 / 64)


def test_paired_t_and_tost_by_hand():
    diffs = [0.01, -0.01, 0.02, 0.0]  # mean 0.005
    out = bs.paired(diffs, margin=0.05)
    sd = math.sqrt(((0.005) ** 2 + 0.015 ** 2 + 0.015 ** 2 + 0.005 ** 2) / 3)
    assert out["mean_diff"] == pytest.approx(0.005) and out["sd"] == pytest.approx(sd)
    se = sd / 2
    assert out["t"] == pytest.approx(0.005 / se)
    half = bs.t_ppf(0.95, 3) * se  # 2.3534 * se
    assert out["interval"] == pytest.approx([0.005 - half, 0.005 + half])
    assert out["equivalent"] is True  # the 90% interval (-0.010, 0.020) lies inside +-0.05
    assert bs.paired(diffs, margin=0.01)["equivalent"] is False
    # the upper one-sided test (H0: mean >= +0.01) is the weaker: t = (0.005 - 0.01) / se
    assert bs.paired(diffs, margin=0.01)["p_tost"] == pytest.approx(bs.t_cdf((0.005 - 0.01) / se, 3))


def test_ratio_target_needs_the_whole_range():
    out = bs.ratio_summary([0.4, 0.45, 0.52], [1.0, 1.0, 1.0], 0.5)
    assert out["ratio_median"] == 0.45 and out["ratio_min"] == 0.4 and out["ratio_max"] == 0.52
    assert out["target_met"] is False
    assert bs.ratio_summary([0.4, 0.45, 0.5], [1.0, 1.0, 1.0], 0.5)["target_met"] is True


def test_max_t_permutation_finds_a_real_shift_and_not_noise():
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 1, size=(20, 6))
    null = bs.max_t_permutation(noise, flips=4000)
    assert null["p_global"] > 0.05
    shifted = noise.copy()
    shifted[:, 3] += 2.0
    out = bs.max_t_permutation(shifted, flips=4000)
    assert out["p_adjusted"][3] < 0.01 and min(p for i, p in enumerate(out["p_adjusted"]) if i != 3) > 0.01
    assert bs.max_t_permutation(np.zeros((5, 3)), flips=100)["p_adjusted"] == [1.0, 1.0, 1.0]


def _row(seed, tamer, trl, tamer_s=1.0, trl_s=2.0):
    curve = lambda accs, s: [[5 * i, s * 5 * i, a] for i, a in enumerate(accs)]  # noqa: E731
    return {"seed": seed, "steps": 20, "eval_every": 5, "tamer_curve": curve(tamer, tamer_s),
            "trl_curve": curve(trl, trl_s)}


def test_learning_summary_by_hand():
    rows = [_row(0, [0.5, 0.9, 0.96, 0.97, 0.98], [0.5, 0.8, 0.95, 0.97, 0.99]),
            _row(1, [0.5, 0.96, 0.96, 0.97, 0.97], [0.5, 0.9, 0.9, 0.96, 0.97]),
            _row(2, [0.5, 0.8, 0.9, 0.9, 0.94], [0.5, 0.9, 0.96, 0.96, 0.96])]
    out = bs.learning_summary(rows, seeds=[0, 1, 2], target=0.95, flips=500)
    assert out["complete"] and out["seeds_done"] == 3
    # plateau = evaluations at steps >= 10: seed 0: (0.96+0.97+0.98)/3 - (0.95+0.97+0.99)/3 = 0
    assert out["plateau"]["mean_diff"] == pytest.approx((0.0 + (0.9667 - 0.9433) + (0.9133 - 0.96)) / 3, abs=1e-3)
    steps = out["steps_to_target"]
    assert steps["tamer"] == [10, 5, None] and steps["trl"] == [10, 15, 10]
    assert (steps["tamer_first"], steps["trl_first"], steps["ties"]) == (1, 1, 1)
    assert steps["censored_at"] == 25 and steps["tamer_never"] == 1
    seconds = out["seconds_to_target"]  # tamer's clock runs at 1 s per step, TRL's at 2
    assert seconds["tamer"] == [10.0, 5.0, None] and seconds["trl"] == [20.0, 30.0, 20.0]
    assert (seconds["tamer_first"], seconds["trl_first"]) == (2, 1)
    assert out["curve_by_step"]["steps"] == [0, 5, 10, 15, 20]
    assert out["curve_by_seconds"]["seconds"][-1] == 20.0  # the shorter run's end
    partial = bs.learning_summary(rows[:2], seeds=[0, 1, 2], target=0.95, flips=100)
    assert not partial["complete"] and partial["missing_seeds"] == [2]


def test_accuracy_at_takes_the_last_evaluation_so_far():
    curve = [[0, 0.0, 0.5], [5, 2.0, 0.8], [10, 4.0, 0.9]]
    assert bs.accuracy_at(curve, 0.0) == 0.5 and bs.accuracy_at(curve, 3.9) == 0.8 and bs.accuracy_at(curve, 9) == 0.9


def test_summarize_cli_reports_missing_seeds(tmp_path):
    """`vs_trl.py --summarize FILE --seeds ...` on per-seed rows: the statistics, and `complete` false
    while a seed is missing."""
    import json
    import subprocess
    rows = [_row(0, [0.5, 0.9, 0.96, 0.97, 0.98], [0.5, 0.8, 0.95, 0.97, 0.99]),
            _row(1, [0.5, 0.96, 0.96, 0.97, 0.97], [0.5, 0.9, 0.9, 0.96, 0.97])]
    path = tmp_path / "learning.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--summarize", str(path),
                          "--seeds", "0-2", "--flips", "200"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "learning_summary" and summary["missing_seeds"] == [2] and not summary["complete"]
    assert summary["steps_to_target"]["tamer"] == [10, 5] and summary["margin"] == 0.01


def test_sft_step_flops_by_hand():
    """hidden 4, 2 layers, MLP 8, 2 heads of 2, 1 KV head, vocab 10; sequences of 3 and 5 tokens, 4 learned.
    Weights per token and layer: q/k/v 4·(2+2)·2 = 32, o 16, MLP 96."""
    from sft_vs_trl import step_flops
    shape = dict(hidden=4, layers=2, mlp=8, heads=2, kv_heads=1, head_dim=2, vocab=10)
    packed = step_flops([5, 3], 4, shape, "packed", budget=16)
    # q/k/v of both layers on 8 tokens, o + MLP of layer 1 on 8 and of the last layer on the 4 learned
    assert packed["linear"] == 6 * (2 * 8 * 32 + 8 * 112 + 4 * 112) == 11136
    assert packed["head"] == 6 * 4 * 4 * 10
    # one group of 2 rows padded to 5: per layer 2 x 7 x 5² x 2 (head dim) x 2 (heads)
    assert packed["attention"] == 2 * (2 * 7 * 25 * 2 * 2) == 2800
    assert packed["total"] == 11136 + 960 + 2800
    padded = step_flops([5, 3], 4, shape, "padded")
    assert padded == {"linear": 6 * 2 * 10 * 144, "attention": 2800, "head": 6 * 10 * 40, "total": 17280 + 2800 + 2400}
    # a budget of 5 padded tokens: groups of one sequence each, rows padded only to their own lengths
    assert step_flops([5, 3], 4, shape, "packed", budget=5)["attention"] == 2 * 7 * (25 + 9) * 2 * 2
    # a 2-token prefix both sequences share: token-wise work on 6 tokens, attention rows unchanged
    shared = step_flops([5, 3], 4, shape, "packed", budget=16, shared=2)
    assert shared["linear"] == 6 * (2 * 6 * 32 + 6 * 112 + 4 * 112) and shared["attention"] == 2800
    with pytest.raises(ValueError, match="layout"):
        step_flops([5], 1, shape, "packing")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install -e '.[bench]')")
def test_sft_vs_trl_smoke(tmp_path):
    """Both SFT sides run on the same batches: tokens per step equal, per-step losses equal."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sft_vs_trl.py"), "--task", "arithmetic",
                          "--steps", "3", "--warmup", "1", "--pairs", "1", "--threads", "1",
                          "--trl-layouts", "padded", "--tamer-layouts", "packed"],
                         capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.strip().splitlines()]
    tamer, trl, summary = rows
    assert tamer["lean_forward"] is True and trl["gradient_checkpointing"] is False
    assert tamer["tokens_per_step"] == trl["tokens_per_step"]
    assert summary["loss_curve_vs_trl"]["padded"]["max_abs_loss_diff"] < 1e-3
    for key in ("speedup_median", "speedup_min", "speedup_max", "target_met", "trl_best_layout"):
        assert key in summary


@pytest.mark.slow
@pytest.mark.parametrize("peer", [False, True])
def test_hf_attention_smoke(tmp_path, peer):
    """The general path's decode attention on/off (or TRL's sdpa/eager) alternated, one row per prompt set."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_attention.py"), "--size", "1m", "--pairs", "2",
                          "--warmup", "1", "--threads", "1"] + (["--peer"] if peer else []),
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [r["prompts"] for r in rows] == ["equal", "varied"]
    assert all(r["pairs"] == 2 for r in rows)
    for row in rows:
        keys = ("generate_ratio_eager_over_sdpa", "learner_ratio_eager_over_sdpa") if peer else ("ratio",)
        assert all(row[k]["min"] > 0 for k in keys)
    if not peer:
        assert rows[0]["on_by_default"] is True and len(set(rows[1]["prompt_tokens"])) == 4  # varied: padding


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["packed", "onednn", "mlp_transposed", "replay"])
def test_packed_decode_smoke(tmp_path, switch):
    """The on/off A/B of a decode setting runs both in one process and reports their ratio (1m: nothing packs)."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "packed_decode.py"), "--size", "1m", "--pairs", "2",
                          "--warmup", "1", "--threads", "1", "--switch", switch],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["pairs"] == 2 and row["switch"] == switch
    from tamer.models import fast_forward
    if switch in ("packed", "onednn"):
        assert row["packs_apply"] is False  # 1m: below PACK_MIN_WEIGHTS
        # this CPU's default, restored after the pairs
        assert row["on_by_default"] is (fast_forward.MKL_PACKED if switch == "packed" else fast_forward.ONEDNN_PACKED)
    else:
        assert row["on_by_default"] is True
    assert row["ratio"]["min"] > 0 and row["on_step_s"]["median"] > 0 and row["off_generate_s"]["median"] > 0
    assert row["on_learn_s"]["median"] > 0 and row["off_learn_s"]["median"] > 0


@pytest.mark.slow
def test_decode_matmul_smoke(tmp_path):
    """Every layout of every decode shape is timed hot and cold, and the shapes are the engine's fused ones."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_matmul.py"), "--size", "1m", "--rows", "4",
                          "--threads", "1", "--cold-mb", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    from tamer.models import fast_forward
    # 1m: hidden 128, 4 query + 2 x 2 KV heads of 32, intermediate 512, 269-token head
    assert [(s["in"], s["out"]) for s in row["shapes"]] == [(128, 256), (128, 128), (128, 1024), (512, 128), (128, 269)]
    for shape in row["shapes"]:
        assert shape["cold_weights"] * shape["in"] * shape["out"] * 4 <= 2 * 2**20 or shape["cold_weights"] == 1
        layouts = ["linear", "left", "left_back"] + ["onednn", "onednn_packed"] * fast_forward.ONEDNN_PACKED_AVAILABLE
        for layout in layouts:
            assert shape[layout]["hot_us"] > 0 and shape[layout]["cold_gb_per_s"] > 0
    assert row["onednn_packed_by_default"] is fast_forward.ONEDNN_PACKED
    assert row["sum_gb_per_s"] > 0


@pytest.mark.slow
def test_sft_attention_groups_smoke(tmp_path):
    """The budget A/B runs both budgets on the same batches and reports their groups and ratios."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sft_attention_groups.py"), "--task", "arithmetic",
                          "--budgets", "180,4096", "--reps", "2", "--steps", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    small, large = row["budgets"]["180"], row["budgets"]["4096"]
    assert small["groups_per_layer"] > large["groups_per_layer"] == 1  # 32 sequences of ~45 tokens: one call
    assert small["ratio_to_first_median"] == 1.0 and large["s_per_step"] > 0 and row["rounds"] == 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (pip install -e '.[bench]')")
def test_sft_vs_trl_block_mode(tmp_path):
    """--interleave-steps: both trainers alive, timed steps alternating in blocks; a ratio per block, same losses
    (--block-steps, the old name, still accepted)."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sft_vs_trl.py"), "--task", "arithmetic",
                          "--steps", "5", "--warmup", "1", "--interleave-steps", "2", "--pairs", "1", "--threads", "1",
                          "--trl-layouts", "padded", "--tamer-layouts", "packed"],
                         capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["blocks"] == 2 and len(summary["block_speedups"]) == 2 and summary["block_steps"] == 2
    assert summary["block_speedup_min"] <= summary["block_speedup_median"] <= summary["block_speedup_max"]
    assert summary["loss_curve_vs_trl"]["padded"]["max_abs_loss_diff"] < 1e-3
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sft_vs_trl.py"), "--steps", "6", "--warmup", "1",
                          "--block-steps", "2", "--trl-layouts", "padded", "--tamer-layouts", "packed"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "multiple" in bad.stderr  # 5 timed steps are not blocks of 2


def test_environment_names_versions_cpu_and_model_digest(tmp_path):
    """Rows carry what their numbers may depend on beyond the code (two machines' runs told apart)."""
    import torch

    from grpo_workers import CPU_FLAGS, environment
    (tmp_path / "model.safetensors").write_bytes(b"weights one")
    first = environment(tmp_path)
    assert first["packages"]["torch"] == torch.__version__ and set(first["cpu_flags"]) <= set(CPU_FLAGS)
    assert first["cpu"] and first["python"].count(".") == 2
    assert environment(tmp_path) == first  # the digest is cached per file path, mtime and size
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert environment(tmp_path)["model_sha256"] != first["model_sha256"]
    bare = environment(packages=("torch", "no-such-package"))  # benchmarks/engines.py: no model, its packages
    assert "model_sha256" not in bare and bare["packages"] == {"torch": torch.__version__, "no-such-package": None}


@pytest.mark.slow
def test_page_faults_smoke(tmp_path):
    """The kept/system A/B runs tamer's worker once per setting and says which allocator setting each had."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "page_faults.py"), "--size", "1m", "--pairs", "1",
                          "--steps", "4", "--warmup", "2", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    *runs, summary = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [(r["setting"], r["malloc"]) for r in runs] == [("kept", "set"), ("system", "off")]
    kept, system = runs
    assert kept["s_per_step"] > 0 and system["s_per_step"] > 0
    # glibc's defaults fault pages in again at every step (thousands); kept, the heap stops growing
    assert system["page_faults_per_step"] > 1000 and kept["page_faults_per_step"] < system["page_faults_per_step"] / 2
    assert summary["pairs"] == 1 and summary["ratio_min"] == summary["ratio_max"] > 0


FAKE_WORKER = '''
import json, sys
sys.path.insert(0, {bench!r})
from bench_workers import pause
spec = json.loads(sys.argv[sys.argv.index("--spec") + 1])
kind = sys.argv[sys.argv.index("--worker") + 1]
for done in range(spec["total"]):
    pause(spec["block"], spec["warmup"], spec["total"], done)
    with open(spec["log"], "a") as f:
        f.write(f"{{kind}}{{done}} ")
print("not json: skipped")
print(json.dumps({{"s_per_step": 1.0, "kind": kind}}), flush=True)
'''


def test_pause_after_the_warmup_and_every_block_but_the_last(monkeypatch, capsys):
    import io
    import json

    import bench_workers
    from bench_workers import SETTLE_S, pause
    monkeypatch.setattr(sys, "stdin", io.StringIO("go\n" * 10))
    events = []  # each hand-over idles SETTLE_S first (the OpenMP threads' spin ends before the other runs)

    def record_print(*args, **kwargs):
        events.append(("out", args[0]))
        print(*args, **kwargs)
    monkeypatch.setattr(bench_workers.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(bench_workers, "print", record_print, raising=False)
    for done in range(8):  # 2 warm-up + 6 timed steps in blocks of 2: ready at 2, 4, 6 (not after the last)
        pause(2, 2, 8, done)
    assert [json.loads(line)["ready"] for line in capsys.readouterr().out.splitlines()] == [2, 4, 6]
    assert SETTLE_S > 0 and [kind for kind, _ in events] == ["sleep", "out"] * 3
    assert all(s == SETTLE_S for kind, s in events if kind == "sleep")
    events.clear()
    for done in range(8):
        pause(0, 2, 8, done)  # off
    assert capsys.readouterr().out == "" and sys.stdin.read() == "go\n" * 7 and events == []


@pytest.mark.parametrize("first", ["tamer", "trl"])
def test_block_pair_alternates_the_workers_steps(tmp_path, first):
    """block_pair: warm-ups one after the other, then blocks in the order A B B A A B ..., each side's
    last JSON line its result."""
    from bench_workers import block_pair
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(bench=str(ROOT / "benchmarks")))
    log = tmp_path / "order.txt"
    spec = dict(total=7, warmup=1, block=2, log=str(log), threads=1)
    other = "trl" if first == "tamer" else "tamer"
    results = block_pair(str(script), {first: spec, other: spec}, first)
    assert {k: r["kind"] for k, r in results.items()} == {"tamer": "tamer", "trl": "trl"}
    a, b = first, other
    assert log.read_text().split() == [f"{a}0", f"{b}0", f"{a}1", f"{a}2", f"{b}1", f"{b}2", f"{b}3", f"{b}4",
                                       f"{a}3", f"{a}4", f"{a}5", f"{a}6", f"{b}5", f"{b}6"]


def test_vs_trl_interleave_steps_must_divide_the_steps():
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--steps", "12",
                          "--interleave-steps", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "multiple" in out.stderr


def test_speed_runs_score_digits_on_both_sides_and_learning_runs_correctness():
    """A random-init model never answers an arithmetic task: the speed runs' reward must still spread within
    a group (else every advantage and gradient is zero). tamer's reward function and TRL's wrapper score one
    text alike."""
    from grpo_workers import LEARNING, SPEED, digit_score, score, tamer_reward
    from tamer.rollout.types import Trajectory
    from tamer.tasks import ArithmeticTasks
    assert SPEED["reward"] == "digits" and LEARNING["reward"] == "correctness"
    assert digit_score("a1b22<|im_end|>", 32) == 3 / 32
    assert digit_score("", 32) == 0.0 and digit_score("x²", 4) == 0.0  # only 0-9 count
    task = ArithmeticTasks().split()[0][0]
    text = f"7 <answer>{task.answer}</answer>"
    traj = Trajectory(task=task, group_id=0, prompt_ids=[], completion_ids=[], loss_mask=[], logprobs=[], text=text)
    speed, learning = dict(SPEED, max_new_tokens=8), dict(LEARNING)
    expected = (1 + len(task.answer)) / 8
    assert score(speed, task, text) == expected
    assert tamer_reward(speed).breakdown(traj) == (expected, {"bench_digits": expected})
    assert score(learning, task, text) == 1.0 and score(learning, task, "7") == 0.0


def test_speed_row_reports_the_timed_updates():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vs_trl import _update_summary
    runs = [{"grad_norms_timed": [0.5, 1.0], "zero_spread_timed": [0.0, 0.25]}, {"grad_norms_timed": [2.0],
                                                                               "zero_spread_timed": [0.5]}]
    assert _update_summary("trl", runs) == {"trl_grad_norm_median": 1.0, "trl_zero_spread_frac": 0.25}
    assert _update_summary("tamer", [{}]) == {"tamer_grad_norm_median": None, "tamer_zero_spread_frac": None}


def test_static_decode_step_is_the_engines_decode_step(tmp_path):
    """benchmarks/compiled_decode.py times a static-shape step: it must compute what `FastDecoder.decode` does
    (the same logits, keys and values up to float rounding, written at the same column, nothing else)."""
    import torch

    from compiled_decode import prefilled, static_inputs, static_step
    fast, kv, key_mask, logits, last = prefilled("1m", tmp_path, torch.get_num_threads())  # threads unchanged
    with torch.inference_mode():  # decode never reads the capacity not yet written; the static step must not either
        for buffer in kv.k + kv.v:
            buffer[:, :, kv.length:] = float("nan")
    for step in range(2):
        tokens, positions = logits.argmax(-1), last + 1 + step
        with torch.inference_mode():
            cs, keys, values, bias, col = static_inputs(fast, kv, key_mask, positions)
            before = [k.clone() for k in keys]
            ours = static_step(fast, tokens, cs, keys, values, bias, col)
            logits = fast.decode(tokens, positions, kv, key_mask)
        assert torch.allclose(ours, logits, atol=1e-5, rtol=0), float((ours - logits).abs().max())
        c = int(col)
        assert c == kv.length - 1  # decode wrote column c and moved on
        for i in range(len(keys)):
            assert torch.allclose(keys[i][:, :, c], kv.k[i][:, :, c], atol=1e-6)
            assert torch.allclose(values[i][:, :, c], kv.v[i][:, :, c], atol=1e-6)
            assert torch.equal(keys[i][:, :, :c], before[i][:, :, :c]) and torch.equal(keys[i][:, :, c + 1:],
                                                                                         before[i][:, :, c + 1:])
            assert not keys[i][:, :, c + 1:].any() and not values[i][:, :, c + 1:].any()  # unwritten: zeros
        assert torch.isinf(bias[:, :, c + 1:]).all()
        assert (bias[0, 0, :c + 1] == 0).sum() == int(key_mask[0, :c + 1].sum())  # the row's real keys


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None, reason="inductor needs a C++ compiler")
def test_compiled_decode_smoke(tmp_path):
    """Both sides run, the compiled step matches the eager one, and the row says what it measured."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compiled_decode.py"), "--size", "1m",
                          "--rounds", "2", "--calls", "3", "--threads", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["wrapper"] == "cpp" and row["rounds"] == 2 and row["rows"] == 32 and row["compile_s"] > 0
    assert row["max_abs_diff_vs_decode"] < 1e-5 and row["max_abs_diff_compiled"] < 1e-5
    assert len(row["ratio"]["ratios"]) == 2 and row["eager_us"] > 0 and row["compiled_us"] > 0
