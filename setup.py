"""Build lmtier: setuptools drives CMake (pybind11 + ninja) to build the one extension ``lmtier._C``.

Environment knobs:
  LMTIER_CUDA=AUTO|ON|OFF   build the CUDA kernels when nvcc is found (AUTO, default), require them, or not
  LMTIER_CUDA_ARCHS=...     CMAKE_CUDA_ARCHITECTURES, e.g. "90" or "80;90" (default "release": every
                            architecture vLLM supports, sm_80/86/89/90/100/120 SASS + compute_120
                            PTX, as release wheels need; narrow it for development builds)
  LMTIER_BUILD_JOBS=N       parallel compile jobs
The module links no libtorch and a static CUDA runtime, so one build serves every torch version and
machines without a GPU driver.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DLMTIER_CUDA={os.environ.get('LMTIER_CUDA', 'AUTO')}",
            f"-DLMTIER_CUDA_ARCHS={os.environ.get('LMTIER_CUDA_ARCHS') or 'release'}",
        ]
        try:
            import ninja  # noqa: F401

            args += ["-G", "Ninja"]
        except ImportError:
            pass
        jobs = os.environ.get("LMTIER_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_temp, check=True)


setup(ext_modules=[CMakeExtension("lmtier._C")], cmdclass={"build_ext": CMakeBuild})
