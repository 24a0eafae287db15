"""LoRA adapters through peft: the config, wrapping a model, the reference as the same model with
its adapters off, saving, loading and merging.

    model = apply_lora(model, LoraConfig(r=16), base_source="path/to/base")   # a peft PeftModel
    ref = AdapterFreeView(model)            # π_ref: the same modules, adapters disabled, no copy
    save_lora_model(model, tokenizer, out)  # adapter + tokenizer (+ base/ when the base has no directory)
    merged = load_lora_dir(out)             # base + adapter merged: a plain transformers model

Only the adapter matrices train (`get_peft_model` freezes every base weight), so gradients and
AdamW moments exist for them alone, and the KL reference needs no second copy of the weights:
peft's `disable_adapter()` runs the base layers only, which is exactly the model the adapter
started from (the adapter's B matrix starts at zero).

A LoRA model directory is peft's adapter (`adapter_config.json`, `adapter_model.safetensors`) and
the tokenizer. Its base is `base/` inside it when the base exists nowhere else on disk (a
`model.tiny`, or a model whose earlier adapter was folded in memory), else the directory named
by `base_model_name_or_path` (an absolute path, itself possibly a LoRA directory). Loading one
merges the adapter into the base (`merge_and_unload`): the result is the model that was trained,
and a new adapter trained on top of it has it as its reference.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tamer.config import ConfigError, FieldError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_DIR = "base"
DEFAULT = "default"  # peft's name of the first adapter: the policy's
ALL_LINEAR = "all-linear"
# The projections of Llama-family decoders (Qwen2/3, Mistral, Gemma): attention and MLP.
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (peft) instead of full fine-tuning; r = 0 trains every weight."""

    r: int = 0  # rank of each adapter; 0: LoRA off (full fine-tuning)
    alpha: float = 32.0  # scaling: the adapter's update is (alpha / r) · B A
    dropout: float = 0.0  # dropout on the adapter's input (training only; 0 keeps the learner deterministic)
    target_modules: tuple[str, ...] = DECODER_PROJECTIONS  # module names that get an adapter, or ["all-linear"]
    seed: int = 0  # random initialisation of the adapters' A matrices (B starts at zero)

    def __post_init__(self) -> None:
        if self.r < 0:
            raise FieldError("r", f"expected >= 0 (0: LoRA off), got {self.r}")
        if self.alpha <= 0:
            raise FieldError("alpha", f"expected > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise FieldError("dropout", f"expected a value in [0, 1), got {self.dropout}")
        if not self.target_modules or any(not isinstance(m, str) or not m for m in self.target_modules):
            raise FieldError("target_modules", f"expected a non-empty list of names, got {self.target_modules!r}")
        if ALL_LINEAR in self.target_modules and len(self.target_modules) > 1:
            raise FieldError("target_modules", f"{ALL_LINEAR!r} stands alone, got {list(self.target_modules)}")

    @property
    def enabled(self) -> bool:
        return self.r > 0


class LoraError(ConfigError):
    """A LoRA setting that does not fit the model, or an adapter directory that cannot be read;
    the message names the config field or the path."""


def _peft():
    try:
        import peft
    except ImportError as err:  # an optional extra
        raise LoraError('model.lora.r > 0 needs peft: pip install "tamer[lora]"') from err
    return peft


def is_lora(model: Any) -> bool:
    """Whether `model` is a peft model (its adapters train, its base is frozen)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def apply_lora(model: torch.nn.Module, config: LoraConfig, base_source: str | Path | None = None) -> torch.nn.Module:
    """`model` wrapped with a fresh LoRA adapter (peft); only the adapter's weights train.

    `base_source`: a directory `load_model` turns into exactly this base (recorded in saved
    adapters); None when there is none (the base is then saved with the adapter)."""
    peft = _peft()
    target = ALL_LINEAR if config.target_modules == (ALL_LINEAR,) else list(config.target_modules)
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [] if target == ALL_LINEAR else [t for t in target if t not in names]
    if missing:
        raise LoraError(f"model.lora.target_modules: no linear layer named {missing[0]!r} in this model "
                        f"(its linear layers: {', '.join(sorted(names))})")
    peft_config = peft.LoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                  target_modules=target, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):  # the same adapters for the same seed, whatever ran before
        torch.manual_seed(config.seed)
        wrapped = peft.get_peft_model(model, peft_config)
    wrapped.tamer_base_source = str(Path(base_source).resolve()) if base_source else None
    return wrapped


def adapter_parameters(model: torch.nn.Module, adapter: str = DEFAULT) -> list[torch.nn.Parameter]:
    """The LoRA matrices of one adapter (A and B of every wrapped layer)."""
    return [p for name, p in model.named_parameters() if f".{adapter}." in name and ".lora_" in name]


def adapter_trained(model: torch.nn.Module, adapter: str = DEFAULT) -> bool:
    """Whether the adapter changes the model (peft starts B at zero: an untrained adapter is the identity)."""
    return any(bool(p.detach().abs().max() > 0) for name, p in model.named_parameters()
               if f".lora_B.{adapter}." in name)


class AdapterFreeView(torch.nn.Module):
    """The base model of a peft model: its forward runs the same modules with every adapter
    disabled. Holds no parameters of its own (the peft model is not registered as a submodule),
    so it costs no memory: the KL reference of a LoRA run."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)
        self.config = peft_model.config

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def get_base_model(self) -> torch.nn.Module:
        return self.peft_model.get_base_model()


@contextlib.contextmanager
def active_adapter(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run `model` with adapter `name` active (e.g. the critic's on a shared trunk).

    peft's `set_adapter` also flips `requires_grad` (only the active adapter trainable); the
    flags are put back, so that each optimizer keeps finding its own parameters."""
    base = model.base_model  # peft's tuner: set_adapter without the PeftModel's checks
    flags = {id(p): p.requires_grad for p in model.parameters()}
    previous = list(model.active_adapters)
    base.set_adapter(name)
    _restore_flags(model, flags)
    try:
        yield
    finally:
        base.set_adapter(previous[0] if len(previous) == 1 else previous)
        _restore_flags(model, flags)


def _restore_flags(model: torch.nn.Module, flags: dict[int, bool]) -> None:
    for p in model.parameters():
        p.requires_grad_(flags.get(id(p), p.requires_grad))


def add_adapter(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """A second adapter `name`, configured as the policy's, on the same frozen base (e.g. PPO's
    critic); returns its parameters, trainable, while the active adapter stays the policy's."""
    model.add_adapter(name, copy.deepcopy(model.peft_config[DEFAULT]))
    params = adapter_parameters(model, name)
    for p in params:
        p.requires_grad_(True)
    return params


# ---------------------------------------------------------------------------- save, load, merge
def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights of a peft model under the plain model's names (adapters left out)."""
    out = {}
    for key, value in model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value
    return out


def save_lora_model(model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """Write the policy adapter and tokenizer into `out` (an empty directory), and the base into
    `out/base` when `model.tamer_base_source` does not name one."""
    source = getattr(model, "tamer_base_source", None)
    model.save_pretrained(out, selected_adapters=[DEFAULT])
    config_path = out / ADAPTER_CONFIG
    adapter_config = json.loads(config_path.read_text(encoding="utf-8"))
    adapter_config["base_model_name_or_path"] = source  # None: the base is in out/base
    config_path.write_text(json.dumps(adapter_config, indent=2), encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if source is None:
        base = model.get_base_model()
        base.save_pretrained(out / BASE_DIR, state_dict=base_state_dict(model))


def is_lora_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def base_dir_of(path: str | Path) -> Path:
    """Where the base of the LoRA directory `path` is: `path/base`, or the recorded directory."""
    path = Path(path)
    if (path / BASE_DIR / "config.json").is_file():
        return path / BASE_DIR
    try:
        recorded = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError) as err:
        raise LoraError(f"{path / ADAPTER_CONFIG}: cannot be read ({err})") from None
    if not recorded:
        raise LoraError(f"{path}: a LoRA adapter without its base (no {BASE_DIR}/ and no base_model_name_or_path)")
    return Path(recorded)


def merge_adapter_dir(base: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """`base` with the adapter saved in `path` merged into its weights (a plain model again)."""
    peft = _peft()
    wrapped = peft.PeftModel.from_pretrained(base, str(path), is_trainable=False)
    return wrapped.merge_and_unload()


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of `model` with its policy adapter merged, under the plain model's names,
    without changing `model` (for export and for a separate sampler's weight sync)."""
    state = base_state_dict(model)
    for name, module in model.get_base_model().named_modules():
        if not hasattr(module, "get_delta_weight") or DEFAULT not in getattr(module, "lora_A", {}):
            continue
        key = f"{name}.weight"
        with torch.no_grad():
            state[key] = state[key] + module.get_delta_weight(DEFAULT).to(state[key].dtype)
    return state


def save_merged_model(model: torch.nn.Module, tokenizer: Any, out: str | Path) -> Path:
    """Write `model` with its policy adapter merged as a plain transformers model directory (for a
    separate sampler such as vLLM, which loads full weights), without changing `model`."""
    out = Path(out)
    model.get_base_model().save_pretrained(out, state_dict=merged_state_dict(model))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def fold_adapter(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Merge a trained policy adapter into the base and start a fresh one on top: the reference
    (adapters off) is then the model as it is now. An untrained adapter is kept as it is."""
    if not is_lora(model) or not adapter_trained(model):
        return model
    base = model.merge_and_unload()
    return apply_lora(base, config, base_source=None)


def set_adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load saved policy-adapter tensors (peft's file) into `model`; returns (missing, unexpected)
    adapter keys."""
    peft = _peft()
    result = peft.set_peft_model_state_dict(model, tensors, adapter_name=DEFAULT)
    missing = [k for k in result.missing_keys if f".{DEFAULT}." in k and ".lora_" in k]
    return missing, list(result.unexpected_keys)
