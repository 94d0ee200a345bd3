"""The tiny adder's character-level tokenizer and chat template, built offline.

Why its own vocabulary: no hub tokenizer is reachable, and one token per character keeps the
vocabulary (102 ids) and so the embedding tiny; the special tokens and the template give the
tiny start the same chat interface as a hub model.
"""

from __future__ import annotations

import string
from typing import Any

PAD_TOKEN, UNK_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, *ROLE_TOKENS.values(), EOS_TOKEN)
# Every printable ASCII character but the rarely used whitespace ones: digits, letters, punctuation,
# \boxed{}, space and newline. Anything else encodes to <unk>.
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")
# <|role|>content<|end|> per message; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the tiny chat template knows the roles system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer() -> Any:
    """A character-level ``transformers.PreTrainedTokenizerFast`` built offline.

    One token per character (WordLevel over single characters, a pre-tokenizer that isolates
    every character, a ``Fuse`` decoder), so ``decode(encode(s)) == s`` for any printable ASCII
    text; special tokens ``<pad>``, ``<unk>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>`` and
    ``<|end|>`` (EOS) and the chat template :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
