"""contrax.integrations.lightly against lightly's own NTXentLoss with
gather_distributed=True: SimCLR steps at W = 1, 2, 4 Gloo ranks
(lightly_steps.py has the checks; `torchrun --nproc_per_node W
lightly_steps.py` runs them by hand). The ranks are the suite's shared rank
processes (launch.ranks): nothing here needs torchrun itself."""
import pytest

pytest.importorskip("lightly", reason="lightly is not installed (requirements/test.txt)")

from launch import ranks  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 4])
def test_lightly_steps_match(world):
    ranks("lightly_steps", world)
