"""contrax.integrations.pylate against PyLate's own losses.Contrastive: ColBERT
steps at W = 1, 2, 4 Gloo ranks (pylate_steps.py has the checks; `torchrun
--nproc_per_node W pylate_steps.py` runs them by hand), and the refusals.
PyLate 1.6.0 pins sentence-transformers 5.3.0, which the sentence-transformers
drop-in is not tested against: tools/setup.sh installs it without its
dependencies (requirements/test-no-deps.txt); its losses need none beyond
ours."""
import pytest

pytest.importorskip("pylate", reason="pylate is not installed (requirements/test-no-deps.txt)")

import torch  # noqa: E402

from contrax.integrations import pylate as cx  # noqa: E402
from launch import ranks  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pylate_steps_match(world):
    ranks("pylate_steps", world)


def test_refusals():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"Contrastive\(\): argument 'score_metric' must be None or "
                                         r"pylate.scores.ColBERTScores\(\) \(Contrax computes ColBERT's MaxSim "
                                         r"itself\), but got function"):
        cx.Contrastive(model, score_metric=lambda q, d: q)
    with pytest.raises(ValueError, match=r"Contrastive\(\): argument 'temperature' must be > 0, but got 0"):
        cx.Contrastive(model, temperature=0)
    with pytest.raises(ValueError, match=r"Contrastive.forward\(\): argument 'sentence_features' must hold the "
                                         r"queries and at least one document column, but got 1 column\(s\)"):
        cx.Contrastive(model)([{"input_ids": torch.zeros(1, 1, dtype=torch.long)}])
