#!/usr/bin/env python3
"""A tiny Qwen3-style tokenizer and transformers goldens for the text tests (`moe_bridge::text`).

Run from the repository root with transformers==5.23.0 (offline, no hub access needed):

    benches/.venv/bin/python tests/make_tokenizer_fixture.py

Writes, under tests/fixtures/tokenizer/:

    tokenizer.json         byte-level BPE built like Qwen2/Qwen3's (NFC, the Qwen2 split regex,
                           ByteLevel pre-tokenizer/decoder/post-processor), trained here on a small
                           English corpus over the printable-ASCII bytes plus newline, with Qwen3's
                           special and added tokens appended at ids 247..255, so that every id fits
                           the vocab 256 of the model fixtures
    tokenizer_config.json  Qwen3's layout: `eos_token` <|im_end|>, `pad_token` <|endoftext|>,
                           `bos_token` null, and Qwen3's (April 2025) chat template verbatim
    goldens.json           what transformers' AutoTokenizer answers: encode (with and without
                           special tokens), decode (skipping special tokens or not, and with
                           `clean_up_tokenization_spaces`, which transformers ignores for BPE
                           unless forced), apply_chat_template (text and ids) for
                           several conversations, and the error of a template that raises

The goldens come from `AutoTokenizer.from_pretrained(dir)` (transformers rebuilds a
`Qwen2Tokenizer` from the vocab and merges); the script also checks that the `tokenizers` library
reading tokenizer.json as-is agrees with it, so the Rust side (which reads tokenizer.json) is
compared against an independent implementation.
"""

import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers  # noqa: E402
from tokenizers import processors, trainers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tokenizer")

# transformers' Qwen2Tokenizer split regex.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's added tokens (special ones first, then the non-special markup tokens the template writes).
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
VOCAB = 256

# The chat template of Qwen/Qwen3-8B (tokenizer_config.json, April 2025), verbatim.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# A ChatML template in the style of older HF templates: roles must alternate (raise_exception),
# `bos_token` / `eos_token` variables, `loop.index0 % 2`, trim_blocks/lstrip_blocks-sensitive
# layout without `-` whitespace control, and a `{% generation %}` block.
ALTERNATING_TEMPLATE = """{{ bos_token if bos_token is defined else '' }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] | trim }}{% endgeneration %}{{ eos_token }}
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model learns to count: one, two, three.
Mixture-of-experts layers route every token to a few experts; the router picks the top two.
Hello world! How are you today? I'm fine, thanks. We'll see what they've said, and it's done.
Tokenizers split text into pieces: words, numbers like 12345 or 2026, and punctuation (like this).
def main():
    print("hello, world")  # a comment
    return 0
The user asks a question and the assistant answers it. Think step by step before you answer.
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
Training data is concatenated, separated by the end-of-sequence token, and cut into rows.
"""

# Texts for encode/decode goldens (non-ASCII characters are outside this tiny vocabulary and are
# dropped by BPE without an unk token; both implementations must agree on that too).
TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they've said it's 12345, isn't it?",
    "  leading and   inner  spaces\n\nand newlines\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer",
    "caf\u00e9 \u2713 na\u00efve",
    "tabs\tand\r\nCRLF",
    "",
]

TOOLS = [
    {
        "function": {
            "description": "Get the weather in a city.",
            "name": "get_weather",
            "parameters": {
                "properties": {"city": {"description": "The city.", "type": "string"}},
                "required": ["city"],
                "type": "object",
            },
        },
        "type": "function",
    }
]

# (name, messages, add_generation_prompt, extra template kwargs)
CHATS = [
    ("single_user", [{"role": "user", "content": "What is the capital of France?"}], True, {}),
    (
        "no_generation_prompt",
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        False,
        {},
    ),
    (
        "system_multi_turn_thinking",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\none, two, three"},
            {"role": "user", "content": "  Now backwards.  "},
        ],
        True,
        {},
    ),
    (
        "last_assistant_keeps_reasoning",
        [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because.", "reasoning_content": "\nThe user asks why.\n"},
        ],
        False,
        {},
    ),
    ("enable_thinking_false", [{"role": "user", "content": "Quick answer please."}], True, {"enable_thinking": False}),
    (
        "tools",
        [
            {"role": "system", "content": "Use tools when needed."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}, "type": "function"}],
            },
            {"role": "tool", "content": "{\"temp\": 21}"},
            {"role": "tool", "content": "sunny"},
        ],
        True,
        {"tools": TOOLS},
    ),
]

ALTERNATING_CHATS = [
    (
        "alternating_ok",
        [
            {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
        True,
        {},
    ),
    ("alternating_raises", [{"role": "assistant", "content": "I start."}], True, {}),
]


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer():
    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    table = bytes_to_unicode()
    alphabet = [table[b] for b in [ord("\n")] + list(range(0x20, 0x7F))]
    n_added = len(SPECIAL) + len(ADDED)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - n_added, min_frequency=1, show_progress=False, initial_alphabet=alphabet, limit_alphabet=len(alphabet), special_tokens=[]
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB - n_added, tok.get_vocab_size()
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def tokenizer_config(tok):
    decoder = {}
    for content in SPECIAL + ADDED:
        decoder[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content in SPECIAL,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": QWEN3_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def chat_goldens(hf, chats, template=None):
    out = []
    for name, messages, add_generation_prompt, kwargs in chats:
        kwargs = dict(kwargs)
        case = {"name": name, "messages": messages, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}
        try:
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template, **kwargs)
        except Exception as err:  # the template raised
            case["error"] = str(err)
            out.append(case)
            continue
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, chat_template=template, return_dict=True, **kwargs)["input_ids"]
        assert ids == hf(text, add_special_tokens=False)["input_ids"], name
        case["text"] = text
        case["ids"] = ids
        out.append(case)
    return out


def main():
    if transformers.__version__ != "5.23.0":
        print(f"warning: goldens were made with transformers 5.23.0, this is {transformers.__version__}", file=sys.stderr)
    tok = build_tokenizer()
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    with open(os.path.join(OUT, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(tok), f, indent=2, ensure_ascii=False)
        f.write("\n")

    # Load through a copy so that nothing transformers might write lands in the fixture.
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(OUT, name), tmp)
        hf = AutoTokenizer.from_pretrained(tmp)
        # transformers ignores `clean_up_tokenization_spaces` for BPE models unless forced.
        hf_cleanup = AutoTokenizer.from_pretrained(tmp, clean_up_tokenization_spaces=True)
        hf_forced = AutoTokenizer.from_pretrained(
            tmp, clean_up_tokenization_spaces=True, clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True
        )
    raw = Tokenizer.from_file(os.path.join(OUT, "tokenizer.json"))

    encode = []
    for text in TEXTS:
        with_special = hf(text, add_special_tokens=True)["input_ids"]
        without = hf(text, add_special_tokens=False)["input_ids"]
        # The tokenizers library reading tokenizer.json as-is must agree with transformers.
        assert raw.encode(text, add_special_tokens=True).ids == with_special, text
        assert raw.encode(text, add_special_tokens=False).ids == without, text
        encode.append({"text": text, "ids": with_special, "ids_no_special": without, "tokens": hf.convert_ids_to_tokens(with_special)})

    decode_ids = [e["ids"] for e in encode if e["ids"]] + [
        [VOCAB - 7, 10, 11, VOCAB - 8, VOCAB - 9],  # <|im_start|> . . <|im_end|> <|endoftext|>
        list(range(0, VOCAB, 7)),
    ]
    cleanup_text = "Hello , world . Is n't it ? I 'm sure ! They 're , we 've"
    decode_ids.append(hf(cleanup_text, add_special_tokens=False)["input_ids"])
    decode = []
    for ids in decode_ids:
        keep = hf.decode(ids, skip_special_tokens=False)
        skip = hf.decode(ids, skip_special_tokens=True)
        assert raw.decode(ids, skip_special_tokens=False) == keep
        assert raw.decode(ids, skip_special_tokens=True) == skip
        decode.append(
            {
                "ids": ids,
                "text": keep,
                "text_skip_special": skip,
                "text_skip_special_cleanup": hf_cleanup.decode(ids, skip_special_tokens=True),
                "text_skip_special_cleanup_forced": hf_forced.decode(ids, skip_special_tokens=True),
            }
        )

    goldens = {
        "transformers": transformers.__version__,
        "vocab_size": VOCAB,
        "special_tokens_map": hf.special_tokens_map,
        "eos_token_id": hf.eos_token_id,
        "pad_token_id": hf.pad_token_id,
        "bos_token_id": hf.bos_token_id,
        "encode": encode,
        "decode": decode,
        "chat": chat_goldens(hf, CHATS),
        "alternating_template": ALTERNATING_TEMPLATE,
        "alternating_chat": chat_goldens(hf, ALTERNATING_CHATS, template=ALTERNATING_TEMPLATE),
    }
    with open(os.path.join(OUT, "goldens.json"), "w", encoding="utf-8") as f:
        json.dump(goldens, f, indent=1, ensure_ascii=False)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
