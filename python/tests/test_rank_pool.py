"""The shared rank processes (rank_pool.py) give each case what a fresh spawn
gave it: a case's settings do not reach the next one, the parent's
environment and directory do; a rank that raises, dies or hangs fails its
case with that rank's traceback, exit status or stack, at once, and the next
case runs on new processes."""
import logging
import os
import signal
import threading
import time
import warnings

import pytest
import torch

import contrax
import rank_pool
from distributed import _entry, _init_file, run


def _record_pid(path, rank):
    with open(f"{path}.{rank}", "a") as f:
        f.write(f"{os.getpid()}\n")


def _change_everything(rank, world, path):
    _record_pid(path, rank)
    torch.manual_seed(1234)
    torch.randn(3)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("medium")
    torch.set_grad_enabled(False)
    torch.autograd.set_detect_anomaly(True)
    torch.set_printoptions(precision=12)
    contrax.set_keep_loss_workspace(False)
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    os.environ["CONTRAX_POOL_PROBE"] = "left by a case"
    os.chdir("/")


def _expect_fresh(rank, world, path, cwd):
    _record_pid(path, rank)
    # torch's generator seeded anew, as in a new process (from the OS, or
    # from torch's fixed default seed in older releases)
    assert torch.initial_seed() != 1234
    assert torch.get_default_dtype() == torch.float32
    assert torch.get_num_threads() == 1  # what _entry sets, as before
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.is_grad_enabled() and not torch.is_anomaly_enabled()
    assert torch._tensor_str.PRINT_OPTS.precision == 4
    assert contrax._contrax.keep_loss_workspace() == (os.environ.get("CONTRAX_KEEP_WORKSPACE") != "0")
    assert logging.root.manager.disable == logging.NOTSET
    assert ("ignore", None, Warning, None, 0) not in warnings.filters
    # The parent's environment and directory at the call, as a spawn inherits them.
    assert "CONTRAX_POOL_PROBE" not in os.environ
    assert os.environ["CONTRAX_POOL_PARENT"] == "set by the parent"
    assert os.getcwd() == cwd


def test_a_case_leaves_nothing_to_the_next(tmp_path, monkeypatch):
    path = str(tmp_path / "pids")
    run(2, _change_everything, path)
    monkeypatch.setenv("CONTRAX_POOL_PARENT", "set by the parent")
    monkeypatch.chdir(tmp_path)
    run(2, _expect_fresh, path, str(tmp_path))
    for rank in range(2):
        pids = open(f"{path}.{rank}").read().split()
        assert len(pids) == 2 and pids[0] == pids[1], "the check is void unless the same process ran both cases"


# ---- failures -----------------------------------------------------------------------
# On the session's pool, as a real failure would be: each replaces the
# processes of its task (a start, seconds, for a later task), so each uses as
# few ranks as shows what it checks, and the others carry on.

def _run(world, fn, *args):
    init_file = _init_file()
    try:
        rank_pool.shared().run(world, _entry, (world, init_file, fn, args), fn.__name__)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def _raise(rank, world):
    raise ValueError(f"the failure of rank {rank}")


def _die_on_rank_1(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)  # rank 0 carries on: the pool must not wait for it


def _hang(rank, world):
    time.sleep(3600)


def _leave_a_thread(rank, world):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="left-behind").start()


def _nothing(rank, world):
    pass


def test_an_exception_fails_the_caller_with_the_ranks_traceback():
    _run(1, _nothing)
    before = rank_pool.shared().pids()
    with pytest.raises(rank_pool.RankError, match=r"(?s)rank 0 of 1 \(pid \d+\) raised during _raise:.*"
                                                  r"in _raise.*ValueError: the failure of rank 0"):
        _run(1, _raise)
    assert rank_pool.shared().pids() == before[1:]  # replaced on the next call, the others kept


def test_a_rank_that_dies_fails_the_caller_at_once():
    _run(2, _nothing)  # started: what follows is timed
    before = rank_pool.shared().pids()
    start = time.monotonic()
    with pytest.raises(rank_pool.RankError, match=r"rank 1 of 2 \(pid \d+\) died with signal SIGSEGV during "
                                                  r"_die_on_rank_1"):
        _run(2, _die_on_rank_1)
    assert time.monotonic() - start < 45  # not after rank 0's 60 s
    assert rank_pool.shared().pids() == before[2:]


def test_a_rank_past_the_deadline_fails_the_caller_with_its_stack():
    pool = rank_pool.shared()
    _run(1, _nothing)  # started within the usual deadline
    before = pool.pids()
    deadline, pool.deadline_s = pool.deadline_s, 3
    try:
        with pytest.raises(rank_pool.RankError, match=r"(?s)rank\(s\) \[0\] of 1 did not finish _hang within 3 s.*"
                                                      r"-- rank 0 of 1 \(pid \d+\):.*in _hang"):
            _run(1, _hang)
    finally:
        pool.deadline_s = deadline
    assert pool.pids() == before[1:]


def test_what_cannot_be_reset_retires_the_process():
    _run(1, _nothing)
    before = rank_pool.shared().pids()
    _run(1, _leave_a_thread)
    assert rank_pool.shared().pids() == before[1:]
