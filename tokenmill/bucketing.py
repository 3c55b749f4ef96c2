"""Cut rows into batches by token length, so no compute is spent on padding.

A batch is padded to its longest row, so it costs rows x longest tokens. Sorting by
length first makes neighbours nearly equal in length; batches are then cut so that
cost stays under the token budget. Like sentence-transformers' encode, callers get
results back in input order (see `restore_order`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PaddingStats:
    real_tokens: int
    padded_slots: int  # rows x longest row, summed over batches

    @property
    def padding_fraction(self) -> float:
        return 0.0 if self.padded_slots == 0 else 1.0 - self.real_tokens / self.padded_slots

    def __add__(self, other: "PaddingStats") -> "PaddingStats":
        return PaddingStats(self.real_tokens + other.real_tokens, self.padded_slots + other.padded_slots)


def plan_batches(
    lengths: Sequence[int], token_budget: int, max_batch_size: int, length_tolerance: float = 0.1
) -> list[list[int]]:
    """Indices into `lengths`, grouped into batches, longest rows first.

    Each batch's padded cost (rows x longest row) stays within token_budget, except
    a single row longer than the budget, which gets a batch of its own. A row joins
    a batch only if it is at most `length_tolerance` shorter than the batch's
    longest, so no row carries more than that share of padding. Longest first puts
    the memory peak at the start, where a too-large budget fails fast.
    """
    if token_budget < 1 or max_batch_size < 1:
        raise ValueError("token_budget and max_batch_size must be at least 1")
    if not 0.0 <= length_tolerance < 1.0:
        raise ValueError("length_tolerance must be in [0, 1)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        length = max(lengths[index], 1)
        if current:
            # sorted descending, so the batch's longest row is its first
            if (
                (len(current) + 1) * longest > token_budget
                or len(current) >= max_batch_size
                or length < longest * (1.0 - length_tolerance)
            ):
                batches.append(current)
                current = []
        if not current:
            longest = length
        current.append(index)
    if current:
        batches.append(current)
    return batches


def input_order_batches(lengths: Sequence[int], token_budget: int, max_batch_size: int) -> list[list[int]]:
    """Batches in input order, each cut when the next row would break the token budget
    (rows x longest row) or the row cap: what batching without length buckets gets."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        grown = max(longest, length)
        if current and ((len(current) + 1) * grown > token_budget or len(current) == max_batch_size):
            batches.append(current)
            current, grown = [], length
        current.append(index)
        longest = grown
    if current:
        batches.append(current)
    return batches


def fixed_batches(count: int, batch_size: int) -> list[list[int]]:
    """The naive plan: fixed-size batches in input order."""
    return [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]


def padding_stats(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> PaddingStats:
    real = padded = 0
    for batch in batches:
        if not batch:
            continue
        batch_lengths = [lengths[i] for i in batch]
        real += sum(batch_lengths)
        padded += max(batch_lengths) * len(batch_lengths)
    return PaddingStats(real, padded)


def restore_order(batches: Sequence[Sequence[int]], results: Sequence[Sequence[object]]) -> list[object]:
    """Results came back batch by batch; put them back at their rows' input positions."""
    total = sum(len(b) for b in batches)
    ordered: list[object] = [None] * total
    for batch, batch_results in zip(batches, results, strict=True):
        if len(batch) != len(batch_results):
            raise ValueError(f"engine returned {len(batch_results)} results for a batch of {len(batch)}")
        for index, result in zip(batch, batch_results):
            ordered[index] = result
    return ordered
