"""contrax.integrations.lightly against lightly's own NTXentLoss with
gather_distributed=True: SimCLR steps under torchrun at W = 1, 2, 4
(lightly_steps.py has the checks)."""
import pytest

pytest.importorskip("lightly", reason="lightly is not installed (requirements/test.txt)")

from launch import torchrun  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 4])
def test_lightly_steps_match(world):
    out = torchrun("lightly_steps.py", world)
    assert "ALL CHECKS PASSED" in out
