"""The server's heap and the garbage collector (server/heap.py): the start's heap frozen, every pause counted."""

import gc

from qwen_triton.server import heap
from qwen_triton.server.metrics import Histogram


def test_the_start_heap_is_frozen_and_collections_skip_it():
    try:
        frozen = heap.freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000  # this process's modules, at least
        assert not any(obj is heap for obj in gc.get_objects())  # frozen objects are no generation's
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_every_collection_is_a_pause_in_the_histogram_once_flushed():
    histogram = Histogram("test_gc_pause_seconds", "")
    pauses = heap.Pauses(histogram).start()
    try:
        gc.collect()
        gc.collect(0)
        assert histogram.count == 0  # recorded, not yet handed over (the callback takes no lock)
        pauses.flush()
        counts, total = histogram.state()
        assert histogram.count >= 2 and total > 0
        pauses.flush()
        assert histogram.count == sum(counts)  # nothing twice
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks
    before = histogram.count
    gc.collect()
    pauses.flush()
    assert histogram.count == before  # closed: no more pauses recorded


def test_a_pause_inside_a_held_metric_lock_does_not_deadlock():
    """The callback runs inside whatever allocation triggers a collection, the histogram's own lock's holder
    included: it must not take that lock."""
    histogram = Histogram("test_gc_pause_seconds", "")
    pauses = heap.Pauses(histogram).start()
    try:
        with histogram._lock:
            gc.collect()  # the callback runs here, with the lock held by this thread
        pauses.flush()
        assert histogram.count >= 1
    finally:
        pauses.close()


def test_the_freeze_can_be_left_out_for_the_comparison(monkeypatch):
    monkeypatch.setenv("QWEN_TRITON_GC_FREEZE", "0")
    assert heap.freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
