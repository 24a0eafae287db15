"""A memory plan: the peak memory one RL step needs per device, before running anything.

    plan = plan_run(config)                    # a RunConfig: model shape, method, batch, precision
    plan.peak_mb, plan.components, plan.phase  # the estimate and what it is made of
    options = what_fits(config, memory_gb=24)  # the run as configured and the changes that bring it under

The estimate adds what stays resident (the runtime, the weights, the reference copy unless LoRA
makes it the same model with adapters off, the critic, gradients, AdamW's two moments) to the
largest transient of the step: the learner's saved activations for one micro-batch plus the
logits' softmax and gradient at the start of backward, or the sampler's KV cache and logits.

On CPU, glibc's allocator does not hand back the previous step's freed gradients before the
next step's are allocated (measured: RSS after one step includes them), so they count twice
(`cpu_allocator`); the lean sampler keeps fused copies of the QKV and gate/up weights (bf16 copies
of every projection under bf16 autocast). The packed decode weights it holds while it
generates in float32 (MKL's layout on Intel CPUs, oneDNN's on AMD ones; at most the weights' size)
are allocated in the heap the previous step's freed gradients left, so they add nothing to the
peak (docs/memory_plan.md: the 35m case).

Activation counts per token are those autograd keeps for backward in tamer's learner forward,
counted exactly with `saved_tensors_hooks` (tests/test_plan.py checks the formula against that
count): per decoder layer 8h + 3·kv + 4i floats on the lean forward with every weight trained,
6h + 2·kv + 4i + 7r with LoRA on a frozen base (HF forward; a frozen projection keeps no input),
and V + 3h for the head (h: hidden size, kv: key/value width, i: MLP width, V: vocabulary, r: LoRA
rank). With gradient checkpointing each layer keeps only its input (h) and one layer is
recomputed at a time. `runtime_mb` is the process before any model (Python, torch,
transformers: about 480 MB on CPU; a CUDA context is about as large). docs/memory_plan.md compares
the estimate with measured peak RSS.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tamer.errors import RunError

MB = 2**20
CPU_RUNTIME_MB = 480.0  # python + torch + transformers + tamer, measured (phases.py's baseline_rss_mb)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PlanError(RunError):
    """A model directory whose config.json does not give a decoder's shape."""


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes (Llama/Qwen-family layout)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = True
    qkv_bias: bool = False

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def decoder_parameters(self) -> int:
        """Embedding, layers and final norm: everything but an untied output head."""
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        if self.qkv_bias:
            per_layer += self.heads * self.head_dim + 2 * self.kv_dim
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden

    def parameters(self) -> int:
        return self.decoder_parameters() + (0 if self.tied else self.vocab * self.hidden)

    def lora_parameters(self, r: int, targets: tuple[str, ...]) -> int:
        shapes = self.linear_shapes()
        names = list(shapes) if targets == ("all-linear",) else [t for t in targets if t in shapes]
        return self.layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in names)


@dataclass(frozen=True)
class Setup:
    """What one RL step runs: method, batch, lengths and precision."""

    prompts: int  # prompts per step
    group_size: int  # samples per prompt
    prompt_tokens: int  # longest prompt
    completion_tokens: int  # longest completion (max_new_tokens; all turns of an agent episode)
    micro_batch_tokens: int = 8192  # padded tokens per learner forward/backward
    generation_batch: int = 256  # sequences sampled at once
    share_prompt_prefix: bool = True  # the learner forwards each group's prompt once
    ppo: bool = False  # PPO's critic (else a group-relative estimator)
    critic: str = "separate"  # separate | shared | adapter
    reference: bool = False  # a KL reference is run (kl_coef > 0)
    lora_r: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = LINEARS
    weight_bytes: int = 4  # model.dtype
    autocast_bf16: bool = False  # rl.precision = bf16
    checkpointing: bool = False  # model.gradient_checkpointing
    replay: bool = False  # the learner reuses the sampler's projection outputs (held from sampling to the update)
    runtime_mb: float = CPU_RUNTIME_MB
    cpu_allocator: bool = True  # CPU (glibc malloc) rather than an accelerator's caching allocator


@dataclass
class Plan:
    """The estimate, in MB, and its parts."""

    components: dict[str, float]  # resident parts (runtime, weights, reference, critic, gradients, optimizer, ...)
    learner_mb: float  # activations + logits of one learner micro-batch
    sampler_mb: float  # KV cache + logits of one generation batch
    parameters: int
    trainable: int

    @property
    def resident_mb(self) -> float:
        return sum(self.components.values())

    @property
    def phase(self) -> str:
        return "learner" if self.learner_mb >= self.sampler_mb else "sampler"

    @property
    def peak_mb(self) -> float:
        return self.resident_mb + max(self.learner_mb, self.sampler_mb)

    def to_dict(self) -> dict[str, Any]:
        return {"peak_mb": round(self.peak_mb, 1), "phase": self.phase, "learner_mb": round(self.learner_mb, 1),
                "sampler_mb": round(self.sampler_mb, 1), "parameters": self.parameters, "trainable": self.trainable,
                "components_mb": {k: round(v, 1) for k, v in self.components.items()}}


def estimate(shape: Shape, s: Setup) -> Plan:
    """Peak memory of one RL step of `s` on a model of `shape`."""
    params = shape.parameters()
    lora = s.lora_r > 0
    adapter = shape.lora_parameters(s.lora_r, s.lora_targets) if lora else 0
    trainable = adapter if lora else params
    trainable_bytes = 4 if lora else s.weight_bytes  # peft keeps adapters in float32
    parts = {"runtime": s.runtime_mb, "weights": (params * s.weight_bytes + adapter * 4) / MB}
    parts["reference"] = params * s.weight_bytes / MB if s.reference and not lora else 0.0
    critic_trainable = 0
    if s.ppo:
        if s.critic == "separate":  # a copy of the decoder (and of the adapter), a value head
            parts["critic"] = (shape.decoder_parameters() * s.weight_bytes + adapter * 4) / MB
            critic_trainable = adapter or shape.decoder_parameters()
        elif s.critic == "adapter":
            parts["critic"] = adapter * 4 / MB
            critic_trainable = adapter
        critic_trainable += shape.hidden + 1
    if not lora:  # the lean sampler's weight snapshot (a LoRA model samples through HF's forward)
        parts["sampler_weights"] = sampler_weights_mb(shape, s)
    if s.replay:  # alive through both phases, so counted with what stays resident
        parts["sampler_activations"] = sampler_activations_mb(shape, s)
    parts["gradients"] = (trainable * trainable_bytes + critic_trainable * trainable_bytes) / MB
    parts["optimizer"] = 2 * parts["gradients"]  # AdamW: exp_avg and exp_avg_sq, in the parameters' dtype
    if s.cpu_allocator:  # glibc keeps the previous step's freed gradients: the next step's are new memory
        parts["retained_gradients"] = parts["gradients"]
    return Plan(parts, learner_activations_mb(shape, s), sampler_mb(shape, s), params, trainable + critic_trainable)


def sampler_weights_mb(shape: Shape, s: Setup) -> float:
    """The lean sampler's snapshot (`FastDecoder.refresh`): fused QKV and gate/up copies in the weights'
    dtype; under bf16 autocast on float32 weights, bf16 copies of every projection and of the head."""
    shapes = shape.linear_shapes()
    if s.autocast_bf16 and s.weight_bytes == 4:
        return (shape.layers * sum(a * b for a, b in shapes.values()) + shape.vocab * shape.hidden) * 2 / MB
    fused = sum(a * b for n, (a, b) in shapes.items() if n not in ("o_proj", "down_proj"))
    return shape.layers * fused * s.weight_bytes / MB


def sampler_activations_mb(shape: Shape, s: Setup) -> float:
    """The decode steps' projection outputs the learner reuses (`tamer.models.replay.DecodeRecord`): per
    sampled row and completion token, q/k/v, output, gate/up and down of every layer and the logits, float32."""
    per_token = shape.layers * (shape.heads * shape.head_dim + 2 * shape.kv_dim + 2 * shape.hidden
                                + 2 * shape.intermediate) + shape.vocab
    return s.prompts * s.group_size * s.completion_tokens * per_token * 4 / MB


def learner_activations_mb(shape: Shape, s: Setup) -> float:
    """Saved activations of one learner micro-batch, plus the logits' softmax and gradient."""
    h, kv, i, vocab, layers = shape.hidden, shape.kv_dim, shape.intermediate, shape.vocab, shape.layers
    width = s.prompt_tokens + s.completion_tokens
    rows = max(1, min(s.prompts * s.group_size, s.micro_batch_tokens // max(1, width)))
    if s.share_prompt_prefix and rows > 1:
        unique = math.ceil(rows / s.group_size)
        tokens = unique * s.prompt_tokens + rows * s.completion_tokens
        logit_tokens = rows * s.completion_tokens
        kv_copies = layers * rows * s.prompt_tokens * 2 * kv  # each row's copy of its prompt's keys and values
    else:
        tokens, logit_tokens, kv_copies = rows * width, rows * width, 0
    # LoRA models run the HF forward, whose RMSNorm keeps its input and x̂ (2h per norm); the lean forward's
    # keeps x̂ alone (`fast_arch._RMSNorm`): 2 norms per layer and the final one hold h less each.
    if s.lora_r > 0:
        per_layer, final = 6 * h + 2 * kv + 4 * i + 7 * s.lora_r, 3 * h
    else:
        per_layer, final = 6 * h + 3 * kv + 4 * i, 2 * h
    kept = tokens * (layers * h + per_layer) if s.checkpointing else tokens * layers * per_layer
    act_bytes = 2 if (s.autocast_bf16 or s.weight_bytes == 2) else 4
    saved = (kept + kv_copies) * act_bytes + logit_tokens * (vocab + final) * 4  # logits are upcast to float32
    backward = 3 * logit_tokens * vocab * 4  # logsumexp and gather's backward: 3 float32 copies at its peak
    return (saved + backward) / MB


def sampler_mb(shape: Shape, s: Setup) -> float:
    """The sampler's KV cache for one generation batch and its per-step logits."""
    rows = min(s.generation_batch // s.group_size * s.group_size or s.group_size, s.prompts * s.group_size)
    kv_bytes = 2 if (s.autocast_bf16 or s.weight_bytes == 2) else 4
    cache = shape.layers * rows * (s.prompt_tokens + s.completion_tokens) * 2 * shape.kv_dim * kv_bytes
    if s.lora_r > 0:
        cache *= 2  # the HF forward's cache grows by concatenation: old and new copies at once
    logits = 3 * rows * shape.vocab * 4
    return (cache + logits) / MB


# ---------------------------------------------------------------------------- from a run's config
def shape_of(config) -> Shape:
    """The model shape a RunConfig describes: `model.path`'s config.json, or `model.tiny`."""
    model = config.model
    if model.path:
        return shape_from_hf(_hf_config_dir(Path(model.path)))
    tiny = model.tiny
    vocab = tiny.vocab_size or _tokenizer_size(model)
    return Shape(vocab=vocab, hidden=tiny.hidden_size, layers=tiny.num_layers, heads=tiny.num_heads,
                 kv_heads=tiny.num_kv_heads, head_dim=tiny.hidden_size // tiny.num_heads,
                 intermediate=tiny.intermediate_size, tied=tiny.tie_word_embeddings, qkv_bias=tiny.arch == "qwen2")


def _hf_config_dir(path: Path) -> Path:
    from tamer.models.lora import base_dir_of, is_lora_dir

    while is_lora_dir(path):
        path = base_dir_of(path)
    return path


def shape_from_hf(path: Path) -> Shape:
    """The shape in a local HF model directory's config.json (no weights read)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PlanError(f"{path}/config.json: cannot be read ({err})") from None
    cfg = cfg.get("text_config", cfg)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in cfg]
    if missing:
        raise PlanError(f"{path}/config.json: no {missing[0]!r} (the plan covers Llama/Qwen-style decoders)")
    heads = cfg["num_attention_heads"]
    return Shape(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                 kv_heads=cfg.get("num_key_value_heads") or heads,
                 head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                 intermediate=cfg["intermediate_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
                 qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)))


def _tokenizer_size(model) -> int:
    from tamer.models import MARKUP_TOKENS, build_char_tokenizer

    if model.tokenizer == "bpe":
        return model.bpe_vocab_size + len(MARKUP_TOKENS) + 1  # the trained vocabulary, markup, <|im_start|>
    return len(build_char_tokenizer())


def setup_of(config, prompt_tokens: int, runtime_mb: float = CPU_RUNTIME_MB, cpu: bool = True,
             single_turn: bool = True) -> Setup:
    """The Setup of a RunConfig's RL phase, with its longest prompt `prompt_tokens`; `single_turn`: its tasks
    name no environment (only single-turn completions' activations are reused)."""
    rl, alg, model = config.rl, config.rl.algorithm, config.model
    replay = (rl.reuse_sampler_activations and rl.on_policy and rl.max_staleness == 0 and rl.fast_forward
              and rl.share_prompt_prefix and rl.precision == "fp32" and rl.engine == "hf" and model.lora.r == 0
              and BYTES[model.dtype] == 4 and not model.gradient_checkpointing and single_turn)
    ppo = alg.advantage == "gae"
    critic = "shared" if rl.critic.shared else "adapter" if rl.critic.adapter else "separate"
    return Setup(prompts=rl.prompts_per_step, group_size=rl.group_size, prompt_tokens=prompt_tokens,
                 completion_tokens=rl.max_new_tokens, micro_batch_tokens=rl.micro_batch_tokens,
                 generation_batch=rl.generation_batch, share_prompt_prefix=rl.share_prompt_prefix, ppo=ppo,
                 critic=critic, reference=alg.kl_coef > 0 or (ppo and rl.critic.kl_in_reward > 0),
                 lora_r=model.lora.r, lora_targets=tuple(model.lora.target_modules),
                 weight_bytes=BYTES[model.dtype], autocast_bf16=rl.precision == "bf16",
                 checkpointing=model.gradient_checkpointing, replay=replay, runtime_mb=runtime_mb, cpu_allocator=cpu)


def prompt_tokens_of(config, sample: int = 64) -> int:
    """The longest prompt among the task's first `sample` training tasks, tokenized as the run will."""
    from tamer.models import build_char_tokenizer, encode_chat
    from tamer.tasks import get_task_source

    if config.model.path or config.model.tokenizer == "bpe":
        from tamer.pipeline import build_policy  # the run's own tokenizer (a BPE is trained on the task)

        tokenizer = build_policy(dataclasses.replace(config.model, lora=dataclasses.replace(config.model.lora, r=0)),
                                 config.task)[1]
    else:
        tokenizer = build_char_tokenizer()
    tasks = get_task_source(config.task).split()[0][:sample]
    return max(len(encode_chat(tokenizer, t.messages)) for t in tasks)  # tool schemas of agent tasks not counted


def plan_run(config, prompt_tokens: int = 0, runtime_mb: float = CPU_RUNTIME_MB,
             cpu: bool = True) -> tuple[Shape, Setup, Plan]:
    from tamer.tasks import get_task_source

    shape = shape_of(config)
    single_turn = get_task_source(config.task).split()[0][0].env is None
    setup = setup_of(config, prompt_tokens or prompt_tokens_of(config), runtime_mb, cpu, single_turn)
    return shape, setup, estimate(shape, setup)


def what_fits(shape: Shape, setup: Setup, memory_gb: float) -> list[dict[str, Any]]:
    """The configured step and common changes, each with its estimate and whether it fits."""
    budget = memory_gb * 1024
    options = [("as configured", {}, setup)]
    if setup.lora_r == 0:
        options.append(("LoRA r=16 (model.lora.r=16)", {"model.lora.r": 16}, dataclasses.replace(setup, lora_r=16)))
    if not setup.checkpointing:
        options.append(("gradient checkpointing (model.gradient_checkpointing=true)",
                        {"model.gradient_checkpointing": True}, dataclasses.replace(setup, checkpointing=True)))
    if setup.micro_batch_tokens > 512:
        half = setup.micro_batch_tokens // 4
        options.append((f"smaller micro-batches (rl.micro_batch_tokens={half})", {"rl.micro_batch_tokens": half},
                        dataclasses.replace(setup, micro_batch_tokens=half)))
    if setup.weight_bytes == 4:
        options.append(("bf16 weights (model.dtype=bfloat16)", {"model.dtype": "bfloat16"},
                        dataclasses.replace(setup, weight_bytes=2)))
    if setup.ppo and setup.critic == "separate":
        options.append(("GRPO instead of PPO (no critic)", {"rl.algorithm.advantage": "grpo"},
                        dataclasses.replace(setup, ppo=False)))
    out = []
    for name, overrides, variant in options:
        peak = estimate(shape, variant).peak_mb
        out.append({"option": name, "overrides": overrides, "peak_mb": round(peak, 1), "fits": peak <= budget})
    return out
