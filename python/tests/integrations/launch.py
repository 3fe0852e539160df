"""Runs a worker script's main() on W ranks and fails the calling test when
any of them fails: on the shared rank processes of the Python tests
(python/tests/rank_pool.py, the cheap way), or under torchrun (PyTorch's
elastic launcher, the way users start their training: a launcher and W new
processes that import torch and the peer library, seconds each), which the
cases that need the launcher itself keep."""
import importlib
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/tests: distributed.py, rank_pool.py

import common  # noqa: E402
from distributed import run_ranks  # noqa: E402

# What a worker sees besides the caller's environment, under both launchers.
WORKER_ENV = dict(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                  PYTHONUNBUFFERED="1")


def _main(rank, world, module):
    importlib.import_module(module).main()


def ranks(module, world):
    """`module`.main() on `world` ranks of the shared rank processes, in a
    Gloo group they make as torchrun's workers would (common.init() finds it
    made), with the group timeout of common.init()."""
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)  # the ranks take the caller's environment at the call
    try:
        run_ranks(world, _main, (module,), timeout_s=common.GROUP_TIMEOUT_S)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def torchrun(script, nproc, *args, timeout=900, env=None):
    """`python -m torch.distributed.run --standalone --nproc_per_node nproc script args...`
    with one thread per worker and no model hub; returns the combined output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, script), *map(str, args)]
    run_env = dict(os.environ, **WORKER_ENV)
    run_env.update(env or {})
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=run_env)
    print(proc.stdout)
    if proc.returncode != 0 and "without libuv support" in proc.stdout:
        # Debian's torch 2.6 is built without libuv, and its torchrun asks for
        # a libuv store whatever the rendezvous backend: it starts nothing.
        pytest.skip("this torch's torchrun cannot start workers: it asks for a libuv store, and this torch is "
                    "built without libuv (Debian's 2.6)")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout
