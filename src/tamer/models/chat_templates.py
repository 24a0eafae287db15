"""Chat templates of real model families, for tokenizers built locally.

    tokenizer = build_family_tokenizer("llama3")           # char-level, Llama 3.1's chat format
    tokenizer = with_chat_family(build_bpe_tokenizer(corpus), "mistral")

Each template renders its family's published conversation and tool-calling format (written
from the formats' documentation, not copied from a model repository), so that prompts, tool
calls and tool results of a tiny local model look token for token like those of the real
family; the tool-call format (`tamer.tools.formats`) is detected from them:

    qwen2.5   ChatML; tools as <tools> JSON lines in the system turn; calls as
              <tool_call>\\n{json}\\n</tool_call>; results grouped in one user turn, each in
              <tool_response>\\n...\\n</tool_response>                         -> hermes
    llama3    Llama 3.1 headers; tools (indented JSON) in the first user turn; a call is the
              whole turn {"name": ..., "parameters": ...} (several joined by "; "); each result
              an `ipython` message                                            -> llama3_json
    mistral   [INST] turns, [AVAILABLE_TOOLS] before the last user turn; calls as
              [TOOL_CALLS] [{"name", "arguments", "id"}]</s>; results as
              [TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]      -> mistral
    json      ChatML; the system turn asks for a bare JSON object per call; results as tool
              messages (set `agent.tool_format=json`: nothing in it is a format marker)

Differences from the published templates, where tamer's token-in/token-out loop needs them:
assistant content is rendered verbatim (no `trim`, no added spaces), so the text a model
samples is the text the template would render; Llama's tool results are not JSON-quoted.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from tamer.models.loading import build_char_tokenizer

# A tool call's function whether given OpenAI-style ({"function": {...}}) or flat.
_FN = "{%- set f = call.function if call.function is defined else call %}"

QWEN25_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}" + _FN +
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + "
    "'}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{%- set ns = namespace(tools_shown=false) %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' and tools and not ns.tools_shown %}"
    "{%- set ns.tools_shown = true %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}. "
    "Do not use variables.\\n\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}" + _FN +
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + (f.arguments | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role in ('tool', 'ipython') %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in rest %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' %}"
    "{%- if loop.index0 == ns.last_user and tools %}"
    "{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' }}{%- if loop.index0 == ns.last_user and system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}" + _FN +
    "{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    "{%- if call.id %}{{- {'name': f.name, 'arguments': f.arguments, 'id': call.id} | tojson }}"
    "{%- else %}{{- {'name': f.name, 'arguments': f.arguments} | tojson }}{%- endif %}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- message.content + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id %}{%- set result = {'content': message.content, 'call_id': message.tool_call_id} %}"
    "{%- else %}{%- set result = {'content': message.content} %}{%- endif %}"
    "{{- '[TOOL_RESULTS] ' + (result | tojson) + '[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

JSON_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You can use these tools:' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n\\nTo use tools, reply with only a JSON object {\"name\": <tool name>, \"arguments\": {...}}, "
    "or a JSON list of such objects. Results come back as tool messages.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.tool_calls | length > 1 %}{{- '[' }}{%- endif %}"
    "{%- for call in message.tool_calls %}" + _FN +
    "{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    "{{- {'name': f.name, 'arguments': f.arguments} | tojson }}"
    "{%- endfor %}"
    "{%- if message.tool_calls | length > 1 %}{{- ']' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# family -> (template, special tokens to add, bos, eos); None keeps the base tokenizer's token.
FAMILIES: dict[str, tuple[str, tuple[str, ...], str | None, str | None]] = {
    "qwen2.5": (QWEN25_TEMPLATE, (), None, None),
    "llama3": (LLAMA3_TEMPLATE, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL_TEMPLATE, ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                   "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]"), "<s>", "</s>"),
    "json": (JSON_TEMPLATE, (), None, None),
}


def with_chat_family(tokenizer: PreTrainedTokenizerFast, family: str) -> PreTrainedTokenizerFast:
    """`tokenizer` (in place) with `family`'s special tokens, BOS/EOS and chat template."""
    if family not in FAMILIES:
        raise ValueError(f"chat family: expected one of {', '.join(FAMILIES)}, got {family!r}")
    template, specials, bos, eos = FAMILIES[family]
    if specials:
        tokenizer.add_special_tokens({"additional_special_tokens": list(specials)},
                                     replace_extra_special_tokens=False)
    if bos is not None:
        tokenizer.bos_token = bos
    if eos is not None:
        tokenizer.eos_token = eos
    tokenizer.chat_template = template
    return tokenizer


def build_family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (`build_char_tokenizer`) speaking `family`'s chat format."""
    return with_chat_family(build_char_tokenizer(), family)
