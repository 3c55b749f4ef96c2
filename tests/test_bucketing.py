import random

import pytest

from tokenmill.bucketing import fixed_batches, padding_stats, plan_batches, restore_order


def skewed_lengths(count, seed=0):
    rng = random.Random(seed)
    return [max(1, min(512, int(rng.lognormvariate(3.5, 1.0)))) for _ in range(count)]


def test_every_row_lands_in_exactly_one_batch():
    lengths = skewed_lengths(2000)
    batches = plan_batches(lengths, token_budget=4096, max_batch_size=64)
    flat = sorted(i for batch in batches for i in batch)
    assert flat == list(range(len(lengths)))


def test_batches_respect_budget_size_and_tolerance():
    lengths = skewed_lengths(2000, seed=1)
    batches = plan_batches(lengths, token_budget=4096, max_batch_size=64, length_tolerance=0.1)
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) <= 64
        assert len(batch) * longest <= 4096 or len(batch) == 1
        assert min(lengths[i] for i in batch) >= longest * 0.9


def test_a_row_longer_than_the_budget_gets_a_batch_of_its_own():
    batches = plan_batches([10, 5000, 10], token_budget=100, max_batch_size=8)
    assert [1] in batches
    assert sorted(i for b in batches for i in b) == [0, 1, 2]


def test_buckets_cut_padding_far_below_input_order_batches():
    lengths = skewed_lengths(5000, seed=2)
    ours = padding_stats(lengths, plan_batches(lengths, 16384, 256, 0.1))
    naive = padding_stats(lengths, fixed_batches(len(lengths), 32))
    assert ours.real_tokens == naive.real_tokens == sum(lengths)
    assert ours.padding_fraction <= 0.05
    assert naive.padding_fraction > 0.5


def test_padding_stats_by_hand():
    stats = padding_stats([4, 2, 3, 3], [[0, 1], [2, 3]])
    assert (stats.real_tokens, stats.padded_slots) == (12, 14)
    assert stats.padding_fraction == pytest.approx(2 / 14)


def test_restore_order_puts_results_back_in_input_order():
    lengths = skewed_lengths(300, seed=3)
    batches = plan_batches(lengths, 1024, 16)
    results = [[f"row{i}" for i in batch] for batch in batches]
    assert restore_order(batches, results) == [f"row{i}" for i in range(300)]


def test_restore_order_refuses_a_short_batch():
    with pytest.raises(ValueError, match="2 results for a batch of 3"):
        restore_order([[0, 1, 2]], [["a", "b"]])


def test_empty_input_makes_no_batches():
    assert plan_batches([], 100, 10) == []
    assert padding_stats([], []).padding_fraction == 0.0


def test_input_order_batches_keep_order_and_respect_the_budget():
    from tokenmill.bucketing import input_order_batches

    lengths = [10, 200, 12, 11, 190, 9, 8, 300]
    batches = input_order_batches(lengths, token_budget=400, max_batch_size=3)
    assert [i for batch in batches for i in batch] == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 400 or len(b) == 1 for b in batches)
    assert all(len(b) <= 3 for b in batches)
    assert batches[0] == [0, 1]  # a third row would make 3 x 200 > 400
