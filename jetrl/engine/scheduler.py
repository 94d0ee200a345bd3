"""Continuous batching: which sequences occupy the engine's fixed slots, and when they stop.

Why: RL completions have very different lengths. A static batch idles every slot whose
sequence has finished until the longest one is done; continuous batching frees a slot the
moment its sequence finishes and admits a waiting prompt at the next admission point.

Rules (host-side, pure Python; the engine owns all tensors):
* A *group* is the ``n`` samples of one prompt. Groups are admitted whole, first in first
  out, when ``n`` slots are free, because the prompt is prefilled once and its K/V copied
  into the ``n`` slots (a group split over two admissions would need a second prefill).
* Slots are handed out lowest index first, so the running set stays packed at the front and
  a decode step over slots [0, ``num_active_rows``) wastes little on empty slots.
* A sequence finishes, after appending a sampled token, on the first rule that applies:
    ``stop``   the token is a stop token id (the token is kept), or the text now contains a
               stop string (the token that completed it is kept; the text is cut later);
    ``length`` it has ``max_tokens`` tokens, or prompt + output fills ``max_len`` (the
               cache has no position left for the next token).
  The engine's on-device freeze uses the same three token rules (engine.py), so host and
  device agree on which tokens belong to a sequence.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from jetrl.engine.sampling import SamplingParams


@dataclass
class Sequence:
    """One completion in flight. ``slot`` is None while waiting and after it finished."""

    prompt_ids: list[int]
    group_index: int
    sample_index: int
    key: int  # 32-bit noise key (sampling.sequence_key)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    slot: int | None = None
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class IncrementalDetokenizer:
    """Text of a growing token list, decoded incrementally (vLLM's prefix/read-offset scheme).

    Decoding token by token is wrong for BPE/SentencePiece (a leading space or a multi-byte
    character spans tokens), decoding everything each step is quadratic. We re-decode only a
    short window ``ids[prefix:]`` and emit the part beyond ``ids[prefix:read]``, holding text
    back while it ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


class StopChecker:
    """Applies the finish rules of the module docstring to one appended token."""

    def __init__(self, params: SamplingParams, stop_token_ids: Seq[int], max_len: int) -> None:
        self.params, self.max_len = params, max_len
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_stop_chars = max((len(s) for s in params.stop), default=0)

    def __call__(self, seq: Sequence, token: int) -> tuple[str, int | str] | tuple[None, None]:
        if token in self.stop_token_ids:
            return "stop", self._reason(token)
        if seq.detokenizer is not None and self.params.stop:
            delta = seq.detokenizer.push(token)
            if delta:  # only the new text (plus a stop string's length of context) can hold a new match
                tail = seq.detokenizer.text[-(len(delta) + self.max_stop_chars - 1) :]
                for s in self.params.stop:
                    if s in tail:
                        return "stop", s
        if len(seq.output_ids) >= self.params.max_tokens or seq.num_tokens >= self.max_len:
            return "length", None
        return None, None

    def _reason(self, token: int) -> int | None:
        """A stop token's ``stop_reason``: the id if the caller asked for it (``stop_token_ids``), None for the
        model's EOS ids the engine adds (vLLM's convention: EOS <=> finish_reason 'stop' and stop_reason None)."""
        return token if token in self.params.stop_token_ids else None

    def first_finish(self, seq: Sequence, tokens: list[int]) -> tuple[int, str, int | None] | None:
        """The token rules of ``__call__`` applied as ``tokens`` are appended to ``seq`` one by one, in one
        pass: (index of the token that finishes it, reason, stop_reason), or None if none does. For
        sequences without stop strings (text needs the detokenizer, token by token).

        After appending token j, ``seq`` holds len(output) + j + 1 tokens, so the length rule first fires at
        j = min(max_tokens - len(output), max_len - num_tokens) - 1 (at once if that is < 0); a stop token at
        or before that index wins, as in ``__call__``.
        """
        room = min(self.params.max_tokens - len(seq.output_ids), self.max_len - seq.num_tokens) - 1
        limit = max(room, 0)
        if self.stop_token_ids:
            for j, token in enumerate(tokens[: limit + 1]):
                if token in self.stop_token_ids:
                    return j, "stop", self._reason(token)
        return (limit, "length", None) if limit < len(tokens) else None


class Scheduler:
    """A FIFO queue of groups and ``num_slots`` slots; see the module docstring for the rules."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.waiting: deque[list[Sequence]] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slot first
        self.num_finished = 0

    def add_group(self, group: list[Sequence]) -> None:
        if len(group) > self.num_slots:
            raise ValueError(f"a group of {len(group)} samples cannot fit in {self.num_slots} slots; raise max_slots")
        self.waiting.append(group)

    def admit(self) -> list[list[Sequence]]:
        """Move waiting groups (FIFO) into free slots while a whole group fits; return them."""
        admitted = []
        while self.waiting and len(self.waiting[0]) <= len(self._free):
            group = self.waiting.popleft()
            for seq in group:
                seq.slot = heapq.heappop(self._free)
                self.running[seq.slot] = seq
            admitted.append(group)
        return admitted

    def append(self, seq: Sequence, token: int, logprob: float, check: Callable[[Sequence, int], tuple]) -> bool:
        """Append a sampled token to a running sequence; finish it (freeing its slot) if a rule fires."""
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        reason, stop_reason = check(seq, token)
        if reason is not None:
            self.finish(seq, reason, stop_reason)
        return seq.is_finished

    def extend(self, seq: Sequence, tokens: list[int], logprobs: list[float], check: StopChecker) -> bool:
        """``append`` each token in turn until one finishes ``seq`` (the rest are dropped), as one list
        extension where no stop string needs the text token by token (the engine's host sync per window)."""
        if seq.detokenizer is not None and check.params.stop:
            for token, logprob in zip(tokens, logprobs):
                if self.append(seq, token, logprob, check):
                    break
            return seq.is_finished
        hit = check.first_finish(seq, tokens)
        n = len(tokens) if hit is None else hit[0] + 1
        seq.output_ids.extend(tokens[:n])
        seq.output_logprobs.extend(logprobs[:n])
        if hit is not None:
            self.finish(seq, hit[1], hit[2])
        return seq.is_finished

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> int:
        """Mark ``seq`` finished and free its slot; returns the freed slot."""
        slot = seq.slot
        seq.finish_reason, seq.stop_reason, seq.slot = reason, stop_reason, None
        del self.running[slot]
        heapq.heappush(self._free, slot)
        self.num_finished += 1
        return slot

    @property
    def num_active_rows(self) -> int:
        """1 + the highest occupied slot (0 if none): a decode step covers slots [0, this)."""
        return max(self.running, default=-1) + 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_in_slot_order(self) -> list[Sequence]:
        return [self.running[s] for s in sorted(self.running)]
