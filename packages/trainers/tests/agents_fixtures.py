"""Offline chat tokenizers with a Qwen2.5-style and a Llama-3-style template with tool messages, and
Qwen3-Coder's published template (built the way ``posttrain model init`` builds its tokenizer)."""

from __future__ import annotations

import functools
from pathlib import Path

from posttrain.trainers.model_init import build_tokenizer

TEMPLATES = Path(__file__).parent / "agents_templates"
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]


@functools.cache
def _base():
    return build_tokenizer(384)


def qwen_tokenizer():
    tok = _base()
    tok = type(tok)(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    return tok


def qwen3_coder_tokenizer():
    """Qwen3-Coder-30B-A3B-Instruct's chat template, as vLLM copies it
    (examples/tool_chat_template_qwen3coder.jinja at 7a3bde4c): XML tool calls, tool results in a user
    turn."""
    tok = _base()
    tok = type(tok)(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (TEMPLATES / "qwen3_coder.jinja").read_text()
    return tok


def llama_tokenizer():
    tok = _base()
    tok = type(tok)(tokenizer_object=tok.backend_tokenizer, pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = (TEMPLATES / "llama3.jinja").read_text()
    return tok
