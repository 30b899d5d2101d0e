"""The multi-turn chat workload of the tiered-offloading blog, scaled to this machine.

``N`` conversations share a system prompt; each starts with its own long first prompt, then for
``rounds`` rounds appends one turn (the assistant's answer and the next user message, as token
ids) and re-sends the whole history. Requests are issued round-robin — every conversation's
round ``r`` before any conversation's round ``r + 1`` — so the KV working set that must survive
between two turns of the same conversation grows linearly with ``N``.

Token ids are drawn from generators seeded by ``(seed, conversation, round)``, never by ``N``:
conversation ``c`` is the same token sequence in every run of a sweep, so reference logits can
be memoized across runs and strategies.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["WorkloadSpec", "ChatRequest", "iter_requests", "conversation_tokens"]


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of the chat workload, in tokens (the blog: 12K-token prompts, +2K per round, 8 rounds)."""

    system_tokens: int = 128
    first_prompt_tokens: int = 384
    turn_tokens: int = 128
    rounds: int = 3
    vocab_size: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("system_tokens", "first_prompt_tokens", "turn_tokens", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")

    @property
    def requests_per_conversation(self) -> int:
        return self.rounds + 1

    def prompt_tokens(self, round_index: int) -> int:
        """Length of a conversation's prompt in round ``round_index`` (0 = the first prompt)."""
        return self.system_tokens + self.first_prompt_tokens + round_index * self.turn_tokens

    @property
    def tokens_per_conversation(self) -> int:
        """Prompt tokens one conversation sends over all its requests."""
        return sum(self.prompt_tokens(r) for r in range(self.rounds + 1))

    def working_set_tokens(self, conversations: int) -> int:
        """Distinct tokens whose KV must stay cached for every turn to be a full prefix hit."""
        private = self.prompt_tokens(self.rounds) - self.system_tokens
        return self.system_tokens + conversations * private


@dataclass(frozen=True)
class ChatRequest:
    """One prefill request: the whole history of ``conversation`` at ``round``."""

    conversation: int
    round: int
    token_ids: list[int]


def _draw(spec: WorkloadSpec, count: int, *salt: int) -> list[int]:
    # A string seed gives the same stream on every Python version and platform.
    rng = random.Random(f"kvtier-bench:{spec.seed}:" + ":".join(map(str, salt)))
    return [rng.randrange(spec.vocab_size) for _ in range(count)]


def conversation_tokens(spec: WorkloadSpec, conversation: int, round_index: int) -> list[int]:
    """The prompt of ``conversation`` in ``round_index``: system prompt + first prompt + turns."""
    if not 0 <= round_index <= spec.rounds:
        raise ValueError(f"round must be in [0, {spec.rounds}], got {round_index}")
    tokens = _draw(spec, spec.system_tokens, -1)
    tokens += _draw(spec, spec.first_prompt_tokens, conversation, 0)
    for r in range(1, round_index + 1):
        tokens += _draw(spec, spec.turn_tokens, conversation, r)
    return tokens


def iter_requests(spec: WorkloadSpec, conversations: int) -> Iterator[ChatRequest]:
    """Every request of a run, round-robin across ``conversations`` (round-major order)."""
    if conversations <= 0:
        raise ValueError(f"conversations must be positive, got {conversations}")
    histories = [conversation_tokens(spec, c, 0) for c in range(conversations)]
    for r in range(spec.rounds + 1):
        for c in range(conversations):
            if r:
                histories[c] = histories[c] + _draw(spec, spec.turn_tokens, c, r)
            yield ChatRequest(c, r, histories[c])
