"""Builds the `contrax._contrax` extension with the project's CMake build.

The extension links the C++ library statically, and LibTorch and
libtorch_python dynamically from the torch that the running interpreter
imports (PyPI's, through torch.utils.cmake_prefix_path, or Debian's), so the
result matches the installed torch exactly. The torch version and C++ ABI it
was built against are recorded in contrax/_build_info.py, which `import
contrax` checks before it loads the extension.

Environment:
  CONTRAX_CMAKE_BUILD_DIR  reuse this existing CMake build of the checkout
                           (configured for the same interpreter) instead of a
                           fresh one under setuptools' build_temp: only the
                           `contrax_python` target is (re)built.
  CMAKE_BUILD_PARALLEL_LEVEL  parallel compile jobs (default: all cores).
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.path.dirname(HERE)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if not os.path.exists(os.path.join(SOURCE_ROOT, "CMakeLists.txt")):
            raise RuntimeError(
                "contrax: setup.py must run inside a Contrax checkout (expected the C++ sources in %s); "
                "install with `python3 -m pip install --no-build-isolation ./python` from the checkout" % SOURCE_ROOT)
        if shutil.which("cmake") is None:
            raise RuntimeError("contrax: cmake is needed to build the extension (apt-get install cmake)")
        build_dir = os.environ.get("CONTRAX_CMAKE_BUILD_DIR")
        if build_dir:
            build_dir = os.path.abspath(build_dir)
            if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
                raise RuntimeError("contrax: CONTRAX_CMAKE_BUILD_DIR=%s is not a configured CMake build" % build_dir)
        else:
            build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
            os.makedirs(build_dir, exist_ok=True)
            import torch.utils  # the torch this interpreter imports (no build isolation)

            # PyPI's CUDA wheels' CMake package needs nvcc; Gloo's headers are not in the wheel.
            if shutil.which("nvcc") is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
                os.environ["PATH"] = "/usr/local/cuda/bin" + os.pathsep + os.environ.get("PATH", "")
            torch_include = os.path.join(os.path.dirname(torch.utils.__file__), "..", "include")
            if not os.path.exists(os.path.join(torch_include, "gloo")):
                subprocess.check_call(["bash", os.path.join(SOURCE_ROOT, "tools", "gloo_headers.sh")],
                                      stdout=subprocess.DEVNULL)
            args = ["cmake", "-S", SOURCE_ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                    "-DCONTRAX_BUILD_TESTS=OFF", "-DCONTRAX_BUILD_PYTHON=ON",
                    "-DCMAKE_PREFIX_PATH=" + torch.utils.cmake_prefix_path,
                    "-DPython3_EXECUTABLE=" + sys.executable]
            if shutil.which("ccache"):
                args.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
            subprocess.check_call(args)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "contrax_python", "-j", jobs])
        built = os.path.join(build_dir, "python", "contrax")
        candidates = [f for f in os.listdir(built) if f.startswith("_contrax") and f.endswith(".so")]
        if len(candidates) != 1:
            raise RuntimeError("contrax: expected one _contrax*.so in %s, found %s" % (built, candidates))
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(built, candidates[0]), target)
        # What the extension was built against, checked at import.
        shutil.copyfile(os.path.join(built, "_build_info.py"), os.path.join(os.path.dirname(target), "_build_info.py"))


setup(ext_modules=[CMakeExtension("contrax._contrax")], cmdclass={"build_ext": CMakeBuild})
