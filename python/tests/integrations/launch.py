"""Runs a worker script under torchrun (PyTorch's elastic launcher, the way
users start their training) and fails the calling test with the workers'
output when any of them fails."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(script, nproc, *args, timeout=900, env=None):
    """`python -m torch.distributed.run --standalone --nproc_per_node nproc script args...`
    with one thread per worker and no model hub; returns the combined output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, script), *map(str, args)]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
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
