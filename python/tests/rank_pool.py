"""The rank processes that the Python suites' distributed cases share.

A spawned rank costs seconds before it runs a line of a test: it imports
torch and contrax (contrax's operators import torch._dynamo: most of it). The
suites' distributed cases are dozens, so instead of a fresh `mp.spawn` per
case, one pool of spawned processes per pytest session (started on first
use) serves them all: a task of world W runs as ranks 0..W-1 on the first W
of them, started as they are needed. Each task still gets what a fresh spawn
gave it (see Pool.run and _Fresh): the parent's environment variables,
working directory and sys.path as they are at the call, and a fresh
process's random state, default dtype, thread count, deterministic, grad and
anomaly modes, print options, warning filters and "once" registry, logging
switch and contrax workspace setting. A process that holds what cannot be
put back (a live Python thread, a process group or communicator left behind,
CUDA in use, autocast or inference mode left on) is replaced after its task.
So are the processes of a failed task: a rank that raises fails the caller
with that rank's traceback, one that dies (a segfault, os._exit) with its
exit status, at once, and one that outlives the deadline with the stacks of
the ranks that did not finish. Whatever broke, the next task gets new
processes, and the suite never hangs.

A process's own state that no reset reaches (a C++ TORCH_WARN_ONCE already
shown, say) is what a case that needs a new process keeps mp.spawn for
(distributed.spawn).
"""
import atexit
import faulthandler
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from multiprocessing import connection
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import contrax

# Past this a task is taken for hung. The slowest distributed case takes
# seconds on an idle machine; a collective that waits for a rank that went
# astray ends at the group's own timeout (60 s) well before this.
DEADLINE_S = float(os.environ.get("CONTRAX_TEST_RANK_DEADLINE", "300"))


class RankError(RuntimeError):
    """A rank of a task raised, died or missed the deadline."""


# ---- the rank processes ----------------------------------------------------------

class _Fresh:
    """The process-wide settings a rank process has when it starts, which a
    fresh spawn would give every task: taken once, put back before each task."""

    def __init__(self):
        # torch seeds its generator from the OS in a new process (older
        # releases: from a fixed seed, which a test that draws without
        # seeding would then see).
        self.seed = torch.initial_seed()
        self.fixed_seed = self.seed == torch.Generator().initial_seed()
        self.rng = torch.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.num_threads = torch.get_num_threads()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.grad = torch.is_grad_enabled()
        self.anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self.print_options = dict(vars(torch._tensor_str.PRINT_OPTS))
        self.logging_disabled = logging.root.manager.disable
        self.logging_level = logging.root.level
        self.logging_handlers = list(logging.root.handlers)
        self.keep_workspace = contrax._contrax.keep_loss_workspace()
        self.threads = set(threading.enumerate())

    def restore(self, environ, cwd, path):
        """Before a task: the parent's environment, directory and path (what a
        spawn inherits), then this process's settings as they were at its start."""
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        for key, value in environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        os.chdir(cwd)
        sys.path[:] = path
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:
            torch.set_default_device(None)
        torch.set_num_threads(self.num_threads)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_grad_enabled(self.grad)
        torch.autograd.set_detect_anomaly(*self.anomaly)
        vars(torch._tensor_str.PRINT_OPTS).update(self.print_options)
        logging.disable(self.logging_disabled)
        logging.root.setLevel(self.logging_level)
        logging.root.handlers[:] = self.logging_handlers
        # A fresh process has shown no warning yet ("once" and "default"
        # actions); the filters themselves are put back by catch_warnings.
        warnings.onceregistry.clear()
        contrax.release_loss_workspace()
        contrax.set_keep_loss_workspace(self.keep_workspace)
        # Python's and NumPy's generators are seeded from the OS in a fresh
        # process (torch's is put back by reseed(), just before the task).
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()

    def reseed(self):
        """torch's generator as in a new process."""
        if self.fixed_seed:
            torch.default_generator.manual_seed(self.seed)
            torch.set_rng_state(self.rng)
        else:
            torch.default_generator.seed()

    def leftovers(self):
        """After a task: what restore() cannot undo, each a reason to retire."""
        found = []
        threads = [t.name for t in threading.enumerate() if t not in self.threads and t.is_alive()]
        if threads:
            found.append(f"Python threads still running: {threads}")
        if dist.is_available() and dist.is_initialized():
            found.append("the default process group is still initialised")
        if contrax._contrax._cache_size():
            found.append("contrax still caches a communicator")
        if len(contrax._ops._world_of_name) > 1:
            found.append("the contrax operators' registry holds a communicator (torch.compile ran)")
        if torch.cuda.is_initialized():
            found.append("CUDA was initialised")
        if torch.is_autocast_enabled("cpu") or torch.is_inference_mode_enabled():
            found.append("autocast or inference mode was left on")
        return found


def _serve(conn, stacks_path):
    """A rank process: runs tasks from the parent, each as the rank the task
    names, until told to stop or the parent is gone."""
    try:
        # On SIGUSR1 (a task past its deadline) every thread's stack goes to
        # this file, which the parent puts into the test's failure.
        stacks = open(stacks_path, "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        fresh = _Fresh()
    except BaseException:
        conn.send(("error", traceback.format_exc(), []))
        return
    conn.send(("ready", None, []))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        rank, environ, cwd, path, payload = task
        try:
            with warnings.catch_warnings():
                fresh.restore(environ, cwd, path)
                entry, args = ForkingPickler.loads(payload)
                fresh.reseed()  # as in a spawn, after the task's modules are imported (above)
                entry(rank, *args)
        except BaseException:
            conn.send(("error", traceback.format_exc(), []))
            continue
        conn.send(("ok", None, fresh.leftovers()))


# ---- the parent's side -----------------------------------------------------------

class _Worker:
    """One rank process and the parent's end of its pipe."""

    def __init__(self, ctx, serial):
        fd, self.stacks_path = tempfile.mkstemp(prefix=f"contrax_rank_process{serial}_stacks_")
        os.close(fd)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, self.stacks_path), name=f"contrax-rank-{serial}")
        self.process.start()
        child.close()
        self.rank = None  # in the task at hand

    def name(self, world):
        return f"rank {self.rank} of {world} (pid {self.process.pid})"

    def exit_status(self):
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            return f"died with signal {signal.Signals(-code).name}"
        return f"died with exit code {code}"

    def stop(self, kill):
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                pass

    def reap(self):
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()
        try:
            os.unlink(self.stacks_path)
        except OSError:
            pass


class Pool:
    """Rank processes, started on demand and reused by every task; see the
    file comment. A task of world W runs as ranks 0..W-1 on the first W
    processes; any process can be any rank. `deadline_s`: how long a task
    (or a start) may take."""

    def __init__(self, deadline_s=DEADLINE_S):
        self._ctx = mp.get_context("spawn")
        self._workers = []
        self._serial = 0  # processes started
        self._tasks = 0
        self._replaced = 0
        self.deadline_s = deadline_s

    def pids(self):
        return [w.process.pid for w in self._workers]

    def run(self, world, entry, args, what):
        """Runs entry(rank, *args) as ranks 0..world-1; raises RankError
        naming `what` if any rank fails. The processes of a task that fails
        are replaced; the pool's others (idle) are kept."""
        __tracebackhide__ = True  # pytest: the failure is the rank's, not this loop's
        self._tasks += 1
        self._grow(world, what)
        workers = self._workers[:world]
        payload = bytes(ForkingPickler.dumps((entry, args)))
        try:
            for rank, w in enumerate(workers):
                w.rank = rank
                try:
                    w.conn.send((rank, dict(os.environ), os.getcwd(), list(sys.path), payload))
                except OSError:
                    raise RankError(f"{w.name(world)} {w.exit_status()} before {what} began; its processes are "
                                    "replaced") from None
            retire = self._collect(workers, world, what)
        except BaseException:
            self._drop(workers, kill=True)
            self._replaced += len(workers)
            raise
        if retire:
            # Not an error of this task: the next one gets fresh processes.
            print(f"rank_pool: new rank processes after {what}: " + "; ".join(f"{w.name(world)}: {reason}"
                                                                          for w, reason in retire), file=sys.stderr)
            self._drop({w for w, _ in retire}, kill=False)
            self._replaced += len({w for w, _ in retire})

    def _grow(self, world, what):
        __tracebackhide__ = True
        new = []
        while len(self._workers) < world:
            self._serial += 1
            new.append(_Worker(self._ctx, self._serial))
            new[-1].rank = len(self._workers)
            self._workers.append(new[-1])
        if new:
            try:
                self._collect(new, world, f"starting rank processes for {what}")
            except BaseException:
                self._drop(new, kill=True)
                raise

    def _drop(self, workers, kill):
        workers = list(workers)
        self._workers = [w for w in self._workers if w not in workers]
        for w in workers:
            w.stop(kill)
        for w in workers:
            w.reap()

    def _collect(self, workers, world, what):
        """Waits for an answer from every one of `workers`; returns the
        (worker, reason) pairs of the state they could not put back."""
        __tracebackhide__ = True
        pending = {w.conn: w for w in workers}
        sentinels = {w.process.sentinel: w for w in workers}
        end = time.monotonic() + self.deadline_s
        retire = []
        while pending:
            ready = connection.wait(list(pending) + list(sentinels), timeout=max(0.0, end - time.monotonic()))
            if not ready:
                raise RankError(self._overdue(list(pending.values()), world, what))
            ready.sort(key=lambda obj: obj in sentinels)  # an answer before a death in the same wake-up
            for obj in ready:
                if obj in pending:
                    w = pending.pop(obj)
                    try:
                        kind, text, reasons = obj.recv()
                    except (EOFError, OSError):
                        raise RankError(self._death(w, world, what)) from None
                    if kind == "error":
                        raise RankError(self._died_first(workers, w, world, what) +
                                        f"{w.name(world)} raised during {what}:\n{text}")
                    retire += [(w, reason) for reason in reasons]
                else:  # a process ended: it never does between tasks
                    raise RankError(self._death(sentinels[obj], world, what))
        return retire

    @staticmethod
    def _death(w, world, what):
        return (f"{w.name(world)} {w.exit_status()} during {what}; its processes are replaced (its output is in "
                "the test's captured stderr)")

    @staticmethod
    def _died_first(workers, raised, world, what):
        """A rank that dies mid-collective makes its peers raise at once
        ("Connection closed by peer"): the death, if there was one, is the
        cause to name first."""
        others = {w.process.sentinel: w for w in workers if w is not raised}
        dead = connection.wait(list(others), timeout=1.0)
        return "".join(Pool._death(others[s], world, what) + "; and then:\n" for s in dead)

    def _overdue(self, late, world, what):
        """The failure of ranks past the deadline, with their stacks."""
        offsets = {w: os.path.getsize(w.stacks_path) for w in late}
        for w in late:
            try:
                os.kill(w.process.pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(1.0)
        parts = [f"rank(s) {[w.rank for w in late]} of {world} did not finish {what} within {self.deadline_s:g} s "
                 "(CONTRAX_TEST_RANK_DEADLINE); their processes are replaced. Their stacks:"]
        for w in late:
            with open(w.stacks_path) as f:
                f.seek(offsets[w])
                parts.append(f"-- {w.name(world)}:\n{f.read() or '(none written)'}")
        return "\n".join(parts)

    def close(self):
        """Stops every rank process."""
        self._drop(self._workers, kill=False)

    def summary(self):
        return (f"rank_pool: {self._tasks} tasks on {self._serial} rank processes "
                f"({self._replaced} replaced after a failure or what they could not reset)")


_shared = None


def shared():
    """The session's pool, started on first use and stopped at exit."""
    global _shared
    if _shared is None:
        _shared = Pool()
        atexit.register(_close_shared)
    return _shared


def _close_shared():
    _shared.close()
    print(_shared.summary(), file=sys.stderr)  # after pytest's own summary: what the pool saved
