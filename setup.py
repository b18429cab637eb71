"""Builds the compiled modules (the memory index's chain walk, the block-key chain, the event decoder's
token-id reader and removal fold, the ingest's removal loops, the built-in tokenizer); everything else is in
pyproject.toml.

Every extension is optional: where one cannot be built, kvroute runs the same code in Python
(``kvroute.indexer.memory.WALK``, ``kvroute.indexer.keys.CHAIN``, ``kvroute.indexer.fastdecode.DECODER``,
``kvroute.indexer.ingest.APPLY``,
``kvroute.sim.tokenizer.TOKENIZER``) and says so at start-up. The key chain links the xxHash C library
(Debian: ``libxxhash-dev``; ``make install`` installs it as root), the same xxh3 the ``xxhash`` package wraps.
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

#: The modules translate and compile in parallel, one job a core (the install and the wheel test build them all).
JOBS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

setup(
    ext_modules=cythonize(
        [
            Extension("kvroute.indexer._walk", ["indexer/_walk.pyx"], optional=True),
            Extension("kvroute.indexer._keychain", ["indexer/_keychain.pyx"], libraries=["xxhash"], optional=True),
            Extension("kvroute.indexer._decode", ["indexer/_decode.pyx"], optional=True),
            Extension("kvroute.indexer._apply", ["indexer/_apply.pyx"], optional=True),
            Extension("kvroute.sim._pieces", ["sim/_pieces.pyx"], optional=True),
        ],
        compiler_directives={"language_level": "3"},
        nthreads=JOBS if JOBS > 1 else 0,
    ),
    options={"build_ext": {"parallel": JOBS}},
)
