"""contrax.integrations.open_clip against open_clip itself: a tiny open_clip
model trained through open_clip_train's loop at W = 1, 2, 4 Gloo ranks
(open_clip_steps.py has the checks; `torchrun --nproc_per_node W
open_clip_steps.py` runs them by hand). The ranks are the suite's shared
rank processes (launch.ranks): nothing here needs torchrun itself, whose
launcher and fresh workers, each importing torch and open_clip, cost
seconds per case."""
import pytest

pytest.importorskip("open_clip", reason="open_clip_torch is not installed (requirements/test.txt)")
pytest.importorskip("open_clip_train", reason="open_clip_torch is not installed (requirements/test.txt)")

from launch import ranks  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 4])
def test_open_clip_steps_match(world):
    ranks("open_clip_steps", world)
