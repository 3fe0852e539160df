"""Contrax's losses and GradCache with FSDP2 (fully_shard) encoders on Gloo
at W = 2 on the CPU: gradients equal the DDP run's (fsdp2_steps.py has the
checks)."""
import pytest
import torch

pytest.importorskip("torch.distributed.fsdp", reason="this torch has no torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip(f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)",
                allow_module_level=True)

from launch import torchrun  # noqa: E402


def test_fsdp2_gradients_equal_ddp():
    # Under torchrun, not the shared rank processes: DTensor's sharding
    # propagation caches its operators' schemas process-wide, device mesh and
    # so process group with them, which a reused process would carry into
    # later cases. Slow: a launcher and two new workers that import torch.
    out = torchrun("fsdp2_steps.py", 2)
    assert "ALL CHECKS PASSED" in out
