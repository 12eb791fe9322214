"""Build the typed Cython kernels in hmacore/_fast (every .pyx there is one extension)."""
import glob
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG_SAN = os.environ.get("HMACORE_SANITIZE") == "1"

compile_args = ["-O3"] if not DEBUG_SAN else ["-O1", "-g", "-fno-omit-frame-pointer",
                                              "-fsanitize=address,undefined"]
if DEBUG_SAN and os.environ.get("HMACORE_FUZZ") == "1":
    # scripts/fuzz.sh: compare operands of the C code feed libFuzzer's value profile (GCC has
    # no edge-coverage mode libFuzzer reads; clang's -fsanitize=fuzzer-no-link would add it)
    compile_args.append("-fsanitize-coverage=trace-cmp")
link_args = [] if not DEBUG_SAN else ["-fsanitize=address,undefined"]

extensions = [
    Extension(
        "hmacore._fast." + os.path.splitext(os.path.basename(path))[0],
        [path],
        include_dirs=[np.get_include(), "hmacore/_fast"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    for path in sorted(glob.glob("hmacore/_fast/*.pyx"))
]

directives = {
    "language_level": 3,
    "boundscheck": False,   # every public entry validates its inputs first
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "embedsignature": True,
}
if DEBUG_SAN:
    directives.update(boundscheck=True, wraparound=True, initializedcheck=True)

setup(ext_modules=cythonize(extensions, compiler_directives=directives,
                            include_path=["hmacore/_fast"]))
