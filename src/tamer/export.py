"""Export a trained model for other tools: merged into a standard Hugging Face model, or as a
plain base plus a peft adapter.

    export_model("runs/x/rl/model", "out", merge=True)   # out/: config.json, model.safetensors, tokenizer
    export_model("runs/x/rl/model", "out", merge=False)  # out/base (plain HF) + out/adapter (peft)

A LoRA run's model directory (`tamer.models.lora`) holds only the adapter and names or contains
its base. `merge=True` writes the base with the adapter merged into its weights: it loads with
`AutoModelForCausalLM.from_pretrained` alone, in any runtime (vLLM, llama.cpp converters, TGI).
`merge=False` keeps the adapter separate, for runtimes that serve adapters on a shared base (vLLM's
`LoRARequest`, peft's `PeftModel.from_pretrained`): `base` is the adapter-free model (earlier
adapters in a chain merged) and `adapter/adapter_config.json` names it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tamer.errors import RunError
from tamer.modeldir import check_model_dir
from tamer.models import is_lora_dir, load_causal_lm, load_model, quiet_progress, save_model
from tamer.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_dir_of
from tamer.storage import atomic_directory


class ExportError(RunError):
    """The source cannot be exported as asked; the message names it."""


def export_model(source: str | Path, out: str | Path, *, merge: bool = True) -> Path:
    """Write `source` (a model directory, LoRA or not) to `out`; returns `out`."""
    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve():
        raise ExportError(f"{out}: the output must differ from the source")
    if merge:
        model, tokenizer = load_model(source)  # a LoRA directory loads merged
        return save_model(model, tokenizer, out)
    if not is_lora_dir(source):
        check_model_dir(source)  # a missing directory says so first
        raise ExportError(f"{source}: not a LoRA model directory (no {ADAPTER_CONFIG}); "
                          "it is a full model already, use it as it is or export --merge")
    _, tokenizer = load_model(source)
    base = load_causal_lm(base_dir_of(source))
    with atomic_directory(out, "the export") as tmp, quiet_progress():
        base.save_pretrained(tmp / "base")
        tokenizer.save_pretrained(tmp / "base")
        (tmp / "adapter").mkdir()
        shutil.copyfile(source / ADAPTER_WEIGHTS, tmp / "adapter" / ADAPTER_WEIGHTS)
        config = json.loads((source / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        config["base_model_name_or_path"] = str((out / "base").resolve())
        (tmp / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out
