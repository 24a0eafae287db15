"""Reward models: Bradley–Terry loss and calibration by hand, preference rows, training, HF save/load, `tamer rm`."""

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from typer.testing import CliRunner

from tamer.algorithms.preference import bradley_terry_loss, calibration
from tamer.cli import app
from tamer.config import load_config
from tamer.learned_rewards import RewardModelScorer, preference_text
from tamer.models import save_model
from tamer.pipeline import RunConfig
from tamer.tasks.dataset import DatasetError
from tamer.tasks.preferences import PreferenceDataConfig, PreferencePair, load_preference_pairs
from tamer.trainers.common import OptimConfig
from tamer.trainers.reward_model import RewardModelConfig, RewardModelTrainer, reward_model_from


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------------------- the math
def test_bradley_terry_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    # −log σ(2) = log(1 + e^−2) = 0.126928; −log σ(0) = log 2 = 0.693147; mean 0.410038
    close(loss, 0.410038)
    close(metrics["accuracy"], 0.5)  # a tie (gap 0) is not a win
    close(metrics["reward_gap"], 1.0)
    close(metrics["reward_mean"], 0.5)  # (2 + 0 + 0 + 0) / 4
    loss.backward()
    # d/dr_c of mean −log σ(g) = −(1 − σ(g)) / B: g=2 → −0.119203/2, g=0 → −0.5/2
    close(chosen.grad, [-0.0596015, -0.25])


def test_bradley_terry_margin_and_centering_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    margins = torch.tensor([1.0, 0.0])
    loss, _ = bradley_terry_loss(chosen, rejected, margins)
    # gaps minus margins: [0, 0] → both log 2
    close(loss, 0.693147)
    loss, _ = bradley_terry_loss(chosen, rejected, None, center_coef=0.5)
    # −log σ(1) = 0.313262, −log σ(0) = 0.693147 → mean 0.503204; centring 0.5 · mean(3², 0²) = 2.25
    close(loss, 0.503204 + 2.25)
    with pytest.raises(ValueError, match="two \\(B,\\) tensors"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


def test_bradley_terry_is_stable_for_large_gaps():
    loss, _ = bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([200.0]))
    close(loss, 400.0, atol=1e-3)  # −log σ(−400) ≈ 400, not inf


def test_calibration_by_hand():
    # gaps 2, −1, 0.1, 3 → confidence σ(|g|) 0.880797, 0.731059, 0.524979, 0.952574; right, wrong, right, right
    report = calibration(torch.tensor([2.0, -1.0, 0.1, 3.0]), bins=2)
    close(report.accuracy, 0.75)
    low, high = report.bins  # [0.5, 0.75): pairs 2 and 3; [0.75, 1): pairs 1 and 4
    assert (low.count, high.count) == (2, 2)
    close(low.confidence, 0.628019)
    close(low.accuracy, 0.5)
    close(high.confidence, 0.916686)
    close(high.accuracy, 1.0)
    # ECE = ½·|0.5 − 0.628019| + ½·|1 − 0.916686| = 0.064010 + 0.041657
    close(report.ece, 0.105667)
    assert calibration(torch.tensor([5.0]), bins=4).bins[0].count == 0  # empty bins are kept, count 0


# ---------------------------------------------------------------------------- data
def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"prompt": "3 kg + 4 kg", "chosen": "<answer>7 kg</answer>", "rejected": "<answer>7</answer>"}


def test_pairs_load_with_margin_and_chat_messages(tmp_path):
    rows = [{**GOOD, "margin": 1.5},
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
             "rejected": "go away", "margin": 0}] * 10
    config = PreferenceDataConfig(path=str(_write(tmp_path / "p.jsonl", rows)), margin_column="margin",
                                  heldout_fraction=0.2)
    train, held = load_preference_pairs(config)
    assert (len(train), len(held)) == (16, 4)
    pairs = train + held
    assert {p.margin for p in pairs} == {1.5, 0.0}
    chat = next(p for p in pairs if p.chosen == "hello")
    assert chat.messages == ({"role": "user", "content": "hi"},) and chat.rejected == "go away"


def test_pairs_from_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD] * 10), path)
    train, held = load_preference_pairs(PreferenceDataConfig(path=str(path)))
    assert len(train) + len(held) == 10 and train[0].chosen == GOOD["chosen"]


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "x", "chosen": "a"', "row 3: invalid JSON"),
    ({"prompt": "x", "chosen": "a"}, "row 3: missing or empty column 'rejected'"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "row 3: missing or empty column 'prompt'"),
    ({"prompt": "x", "chosen": "a", "rejected": "a"}, "row 3: chosen and rejected replies are identical"),
    ({"prompt": "x", "chosen": 7, "rejected": "b"}, "row 3: missing or empty column 'chosen'"),
    ({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "last message must be the assistant's"),
    ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}, "column 'prompt', message 0"),
    ({**GOOD, "margin": "big"}, "row 3: column 'margin' must be a number >= 0"),
    ({**GOOD, "margin": -1}, "row 3: column 'margin' must be a number >= 0"),
])
def test_malformed_preference_rows_name_file_and_row(tmp_path, bad, message):
    path = _write(tmp_path / "p.jsonl", [{**GOOD, "margin": 1}, {**GOOD, "margin": 0}, bad])
    with pytest.raises(DatasetError, match=message) as err:
        load_preference_pairs(PreferenceDataConfig(path=str(path), margin_column="margin"))
    assert str(err.value).startswith(f"{path}, row 3") or "invalid JSON" in str(err.value)


def test_preference_data_needs_a_source():
    with pytest.raises(DatasetError, match="rm.data"):
        load_preference_pairs(PreferenceDataConfig())


# ---------------------------------------------------------------------------- model and training
def _unit_pairs(n, seed=0):
    """'States the unit' preferences: the only difference between replies is ' kg'."""
    import random

    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        pairs.append(PreferencePair(({"role": "user", "content": f"{a} kg + {b} kg"},),
                                    f"<answer>{a + b} kg</answer>", f"<answer>{a + b}</answer>"))
    return pairs


def test_reward_model_learns_pairs_and_saves_as_hf_model(tiny_model, tokenizer, tmp_path):
    rm, rm_tokenizer = reward_model_from(tiny_model, tokenizer)
    assert rm_tokenizer.padding_side == "right" and tokenizer.padding_side == "left"  # the policy's is untouched
    trainer = RewardModelTrainer(rm, rm_tokenizer, _unit_pairs(64), _unit_pairs(16, seed=1),
                                 RewardModelConfig(steps=30, batch_size=8, eval_every=0,
                                                   optim=OptimConfig(lr=3e-3, warmup_steps=0)))
    close(trainer.heldout_gaps(), torch.zeros(16))  # zero head: every pair starts at P = 0.5
    report = trainer.train()
    assert report.accuracy == 1.0 and report.mean_confidence > 0.6
    path = save_model(rm, rm_tokenizer, tmp_path / "rm")
    # Plain transformers loads it as a sequence classifier and gives the scorer's numbers.
    loaded = AutoModelForSequenceClassification.from_pretrained(path)
    loaded_tok = AutoTokenizer.from_pretrained(path)
    messages = ({"role": "user", "content": "2 kg + 5 kg"},)
    texts = [preference_text(loaded_tok, messages, r) for r in ("<answer>7 kg</answer>", "<answer>7</answer>")]
    enc = loaded_tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        plain = loaded(**enc).logits[:, 0]
    ours = RewardModelScorer.load(path).score_pairs([messages] * 2, ["<answer>7 kg</answer>", "<answer>7</answer>"])
    close(plain, ours, atol=1e-5)
    assert ours[0] > ours[1]


def test_cli_rm_trains_and_reports(tmp_path):
    data = _write(tmp_path / "prefs.jsonl", [{"prompt": p.messages[0]["content"], "chosen": p.chosen,
                                              "rejected": p.rejected, "margin": 0.5} for p in _unit_pairs(40)])
    sets = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
            "tracking.tensorboard=false", "tracking.console=false", "rm.steps=4", "rm.batch_size=4",
            "rm.data.margin_column=margin"]
    args = ["rm", "--data", str(data), "-o", str(tmp_path / "out")] + [a for s in sets for a in ("--set", s)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "held-out pairwise accuracy" in result.output
    summary = json.loads((tmp_path / "out" / "rm" / "summary.json").read_text())
    assert summary["heldout_pairs"] == 4 and 0.0 <= summary["rm_ece"] <= 1.0
    assert (tmp_path / "out" / "rm" / "model" / "config.json").is_file()
    bad = _write(tmp_path / "bad.jsonl", [GOOD, {"prompt": "x", "chosen": "a"}])
    result = CliRunner().invoke(app, ["rm", "--data", str(bad), "-o", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "bad.jsonl, row 2: missing or empty column 'rejected'" in result.output


def test_rm_config_section_checks_fields():
    cfg = load_config(RunConfig, None, ["rm.steps=5", "rm.data.path=x.jsonl"])
    assert cfg.rm.steps == 5 and cfg.rm.data.path == "x.jsonl"
    with pytest.raises(ValueError, match="rm.batch_size"):
        load_config(RunConfig, None, ["rm.batch_size=0"])


def test_pairs_from_hf_datasets_directory_and_saved_dataset(tmp_path):
    import datasets

    folder = tmp_path / "hub_like"
    folder.mkdir()
    _write(folder / "train.jsonl", [GOOD] * 6)
    _write(folder / "test.jsonl", [{**GOOD, "chosen": "<answer>7 kg!</answer>"}] * 3)
    train, held = load_preference_pairs(PreferenceDataConfig(hf_dataset=str(folder), hf_heldout_split="test"))
    assert (len(train), len(held)) == (6, 3) and held[0].chosen == "<answer>7 kg!</answer>"
    assert train[0].source == f"{folder}, row 1"
    saved = tmp_path / "saved"
    rows = [GOOD] * 4 + [{**GOOD, "rejected": ""}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(saved)
    with pytest.raises(DatasetError, match=f"{saved}, row 5: missing or empty column 'rejected'"):
        load_preference_pairs(PreferenceDataConfig(hf_dataset=str(saved)))
    with pytest.raises(DatasetError, match="could not be loaded"):
        load_preference_pairs(PreferenceDataConfig(hf_dataset=str(tmp_path / "nothing-here")))
