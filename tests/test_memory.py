"""HeapGuard: the freed heap is given back between engine calls only once the process has grown."""

import ctypes.util
import sys

import pytest

from tokenmill.memory import HeapGuard, release_freed_heap, resident_bytes

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                           reason="malloc_trim is glibc's")


def test_resident_bytes_reads_this_process():
    before = resident_bytes()
    held = b"x" * (48 << 20)  # written, so resident
    assert resident_bytes() - before >= 40 << 20
    del held


@glibc
def test_a_heap_that_does_not_grow_is_never_trimmed():
    guard = HeapGuard(slack_bytes=256 << 20)
    for _ in range(50):
        guard.before_call()
        scratch = bytearray(b"y" * (4 << 20))  # a call's activations, freed before the next
        del scratch
    assert guard.trims == 0 and guard.floor is not None


@glibc
def test_growth_past_the_slack_is_trimmed_and_the_floor_measured_again():
    release_freed_heap()  # what earlier tests freed must not be given back inside this one
    guard = HeapGuard(slack_bytes=32 << 20)
    guard.before_call()  # the first call: nothing to judge yet
    assert guard.floor is None
    guard.before_call()  # after one call: the floor
    floor = guard.floor
    assert floor is not None and guard.trims == 0
    grown = b"z" * (96 << 20)  # the process now holds 96 MiB more than the floor
    guard.before_call()
    assert guard.trims == 1 and guard.floor is None  # trimmed; the floor is re-measured after the next call
    guard.before_call()
    assert guard.floor is not None and guard.floor >= floor + (64 << 20)  # live memory is not trimmed away
    guard.before_call()
    assert guard.trims == 1  # and does not trim again without more growth
    del grown


@glibc
def test_release_freed_heap_returns_freed_memory():
    blocks = [bytearray(b"w" * (100 << 10)) for _ in range(1500)]  # ~150 MiB of heap-sized blocks
    del blocks[::2]  # every other one freed: holes the heap keeps
    held = resident_bytes()
    assert release_freed_heap()
    assert resident_bytes() < held - (40 << 20)
    del blocks
