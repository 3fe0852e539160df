"""Writes the crafted checkpoints of train_checkpoint_safety_test.cpp into DIR.

Each is a file an attacker could leave where a run's checkpoint.pt should
be, in the earlier checkpoint format (TorchScript / torch.save zip
archives, which LibTorch's reader unpickles and runs):

  setstate.pt     a TorchScript module whose __setstate__ writes DIR/setstate_ran
  pickle_global.pt  a torch.save pickle whose __reduce__ calls os.system (writes DIR/pickle_ran)
  zip_bomb.pt     a zip archive whose one member inflates to 512 MiB of zeros

Usage: python3 crafted_checkpoints.py DIR
"""
import os
import sys
import zipfile

import torch


def setstate(path, marker):
    # The marker's path is baked into the scripted method's source.
    src = f'''
class Payload(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.ones(1)

    @torch.jit.export
    def __getstate__(self):
        return (self.x, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[torch.Tensor, bool]):
        self.x = state[0]
        self.training = state[1]
        torch.save(torch.ones(1), "{marker}")
'''
    scope = {"torch": torch}
    exec(compile(src, path + ".py", "exec"), scope)
    linecache_source(path + ".py", src)
    torch.jit.save(torch.jit.script(scope["Payload"]()), path)


def linecache_source(name, src):
    # torch.jit.script reads a class's source through linecache.
    import linecache
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)


class Reduce:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def pickle_global(path, marker):
    torch.save({"contrax_checkpoint_format": 2, "x": Reduce(f"touch {marker}")}, path)


def zip_bomb(path):
    chunk = bytes(1 << 20)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open("archive/data/0", "w", force_zip64=True) as f:
            for _ in range(512):
                f.write(chunk)
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")


def main(out):
    setstate(os.path.join(out, "setstate.pt"), os.path.join(out, "setstate_ran"))
    pickle_global(os.path.join(out, "pickle_global.pt"), os.path.join(out, "pickle_ran"))
    zip_bomb(os.path.join(out, "zip_bomb.pt"))


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    main(sys.argv[1])
