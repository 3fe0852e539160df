"""contrax.integrations.open_clip against open_clip itself: a tiny open_clip
model trained through open_clip_train's loop under torchrun at W = 1, 2, 4
(open_clip_steps.py has the checks)."""
import pytest

pytest.importorskip("open_clip", reason="open_clip_torch is not installed (requirements/test.txt)")
pytest.importorskip("open_clip_train", reason="open_clip_torch is not installed (requirements/test.txt)")

from launch import torchrun  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 4])
def test_open_clip_steps_match(world):
    out = torchrun("open_clip_steps.py", world)
    assert "ALL CHECKS PASSED" in out
