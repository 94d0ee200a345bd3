"""Tasks and datasets as records ``{"prompt": messages, "ground_truth": str, "task": str}``.

``tasks.py`` generates them offline (reasoning-gym, synthetic arithmetic), ``datasets.py``
loads them from jsonl/parquet (verl or plain format) and splits off a held-out set, ``chat.py``
turns them into prompt ids with the tokenizer's chat template.
"""

from jetrl.data.chat import PromptTooLongError, check_prompt_lengths, encode_prompt, encode_prompts
from jetrl.data.datasets import DatasetError, load_records, normalize_record, save_records, split_eval
from jetrl.data.records import Message, Record, make_record, to_messages
from jetrl.data.tasks import BOXED_INSTRUCTION, reasoning_gym_records, synthetic_record, synthetic_split

__all__ = [
    "BOXED_INSTRUCTION",
    "DatasetError",
    "Message",
    "PromptTooLongError",
    "Record",
    "check_prompt_lengths",
    "encode_prompt",
    "encode_prompts",
    "load_records",
    "make_record",
    "normalize_record",
    "reasoning_gym_records",
    "save_records",
    "split_eval",
    "synthetic_record",
    "synthetic_split",
    "to_messages",
]
