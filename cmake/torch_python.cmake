# The Python interpreter whose torch this build uses, for the Python package
# and the tests that start torchrun: the one given (Python3_EXECUTABLE);
# else the virtual environment PyPI's LibTorch lives in (Torch_DIR is
# <venv>/lib/pythonX.Y/site-packages/torch/share/cmake/Torch); else the
# system's python3 (Debian's python3-torch).
if(NOT DEFINED Python3_EXECUTABLE)
  set(_dir "${Torch_DIR}")
  while(_dir AND NOT EXISTS "${_dir}/pyvenv.cfg" AND NOT _dir STREQUAL "/")
    get_filename_component(_dir "${_dir}" DIRECTORY)
  endwhile()
  if(EXISTS "${_dir}/pyvenv.cfg" AND EXISTS "${_dir}/bin/python3")
    set(Python3_EXECUTABLE "${_dir}/bin/python3")
  elseif(EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3)
  endif()
endif()
find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
