"""Checkpoint round trip on a tiny Qwen2: weights, optimizer, scheduler, RNG; atomicity; pruning."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tamer.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def _tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config)


def _training_setup(seed: int = 0):
    model = _tiny_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train_steps(model, optimizer, scheduler, n: int = 2) -> None:
    for _ in range(n):
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def test_round_trip_restores_weights_optimizer_scheduler_rng(tmp_path):
    model, optimizer, scheduler = _training_setup(seed=0)
    _train_steps(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler,
                           state={"data_position": 17})
    expected = (torch.rand(3), random.random(), np.random.rand())

    fresh, fresh_opt, fresh_sched = _training_setup(seed=1)
    torch.rand(5)  # move the RNG on, so restore has something to undo
    state = load_checkpoint(path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)

    assert state == {"data_position": 17, "step": 2}
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied
    assert fresh_sched.last_epoch == scheduler.last_epoch == 2
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()
    saved_opt, loaded_opt = optimizer.state_dict(), fresh_opt.state_dict()
    assert saved_opt["param_groups"] == loaded_opt["param_groups"]
    for key, slot in saved_opt["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(slot[field], loaded_opt["state"][key][field])


def test_rng_after_restore_matches_rng_after_save(tmp_path):
    model = _tiny_model()
    path = save_checkpoint(tmp_path, 0, model=model)
    after_save = (torch.rand(4), random.random(), np.random.rand())
    torch.rand(10), random.random(), np.random.rand(3)
    load_checkpoint(path, model=_tiny_model(seed=3))
    after_restore = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(after_save[0], after_restore[0])
    assert after_save[1:] == after_restore[1:]


def test_training_continues_identically_after_resume(tmp_path):
    model, optimizer, scheduler = _training_setup()
    _train_steps(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler)
    _train_steps(model, optimizer, scheduler)

    resumed, resumed_opt, resumed_sched = _training_setup(seed=5)
    load_checkpoint(path, model=resumed, optimizer=resumed_opt, scheduler=resumed_sched)
    _train_steps(resumed, resumed_opt, resumed_sched)
    for name, tensor in model.state_dict().items():
        assert torch.allclose(tensor, resumed.state_dict()[name], atol=1e-6), name


def test_saved_dir_loads_with_from_pretrained(tmp_path):
    model = _tiny_model()
    path = save_checkpoint(tmp_path, 5, model=model)
    assert path.name == "step-000005" and (path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-6)


def test_leftover_temp_dir_is_ignored_and_cleaned(tmp_path):
    model = _tiny_model()
    first = save_checkpoint(tmp_path, 1, model=model)
    # a save of step 2 that crashed halfway: a temp dir with partial contents
    crashed = tmp_path / ".tmp-step-000002-deadbeef"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"partial")
    # and a step dir with no trainer state (e.g. copied by hand, incomplete)
    (tmp_path / "step-000003").mkdir()
    assert latest_checkpoint(tmp_path) == first
    (tmp_path / "latest").unlink()  # the fallback scan must agree
    assert latest_checkpoint(tmp_path) == first
    save_checkpoint(tmp_path, 4, model=model)
    assert not crashed.exists()


def test_keep_last_prunes_older_steps(tmp_path):
    model = _tiny_model()
    for step in (10, 20, 30, 40):
        last = save_checkpoint(tmp_path, step, model=model, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert names == ["step-000030", "step-000040"]
    assert latest_checkpoint(tmp_path) == last
    assert (tmp_path / "latest").read_text().strip() == "step-000040"
    save_checkpoint(tmp_path, 40, model=model, keep_last=None)  # re-saving a step replaces it
    assert latest_checkpoint(tmp_path) == last


def test_missing_or_mismatched_checkpoint_raises(tmp_path):
    model = _tiny_model()
    assert latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(CheckpointError, match="nothing"):
        load_checkpoint(tmp_path / "nothing", model=model)
    path = save_checkpoint(tmp_path, 1, model=model)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match="do not match"):
        load_checkpoint(path, model=other)
    with pytest.raises(CheckpointError, match="optimizer"):
        load_checkpoint(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(path, model=model)


def test_plain_module_without_save_pretrained(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    path = save_checkpoint(tmp_path, 3, model=net, state={"epoch": 1})
    copy = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert load_checkpoint(path, model=copy, restore_rng=False) == {"epoch": 1, "step": 3}
    for a, b in zip(net.parameters(), copy.parameters()):
        assert torch.equal(a, b)
