"""The step slot's caches let go of entries whose tensors are freed, even when freeing happens inside the slot's own
locked block (replacing a row's marks frees the tensor a cached row state was keyed on): no deadlock."""

import threading

import torch

from blockdiag_cp.step.slot import StepSlot
from blockdiag_cp.testing import hang_timeout


class Owner:
    """Stands for a config: the row marks are noted per owner."""


def test_replacing_row_marks_that_key_a_cached_state_does_not_deadlock():
    slot, owner = StepSlot(), Owner()

    def forwards():
        for _ in range(3):  # each forward notes new marks (freeing the last ones) and plans on them
            cu = torch.tensor([0, 4, 9], dtype=torch.int32)
            slot.note_row_marks(owner, 9, cu)
            assert slot.implicit_state((cu,), "row", lambda: "planned") == "planned"
            del cu
        slot.note_row_marks(owner, 9, None)

    worker = threading.Thread(target=forwards, daemon=True)
    worker.start()
    worker.join(timeout=hang_timeout(30))
    assert not worker.is_alive(), "the slot deadlocked on a finalizer"
    assert slot.row_marks(owner, 9) is None and len(slot._implicit) <= 1  # freed entries are forgotten


def test_row_marks_are_per_owner_and_length_and_go_with_the_owner():
    slot, a, b = StepSlot(), Owner(), Owner()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    slot.note_row_marks(a, 5, cu)
    assert slot.row_marks(a, 5) is cu and slot.row_marks(a, 6) is None and slot.row_marks(b, 5) is None
    del a
    import gc

    gc.collect()
    slot.row_marks(b, 5)  # forgets what was freed
    assert not slot._row_marks
