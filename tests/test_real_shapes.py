"""A real model size on CPU: Qwen2.5-0.5B's shape (random init, local tokenizer), LoRA r=16, two
GRPO steps in their own process; its peak RSS against `tamer plan`'s estimate (slow tier)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_two_grpo_steps_on_the_qwen2_5_0_5b_shape_with_lora(tmp_path):
    from memory_plan import measure

    result = measure("0.5b", steps=2, threads=2, output_dir=str(tmp_path))
    print(json.dumps(result))
    assert result["parameters"] == 494_032_768 and result["trainable"] == 8_798_208 and result["lora_r"] == 16
    assert result["reference"] and result["models_held"] == 1  # π_ref: the same model with its adapter off
    assert len(result["step_seconds"]) == 2 and all(s > 0 for s in result["step_seconds"])
    assert abs(result["error_pct"]) < 15, result
