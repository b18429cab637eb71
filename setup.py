"""Builds the compiled modules (the memory index's chain walk, the built-in tokenizer); everything else is
in pyproject.toml.

Both extensions are optional: where one cannot be built, kvroute runs the same code in Python
(``kvroute.indexer.memory.WALK``, ``kvroute.sim.tokenizer.TOKENIZER``) and says so at start-up.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [
            Extension("kvroute.indexer._walk", ["indexer/_walk.pyx"], optional=True),
            Extension("kvroute.sim._pieces", ["sim/_pieces.pyx"], optional=True),
        ],
        compiler_directives={"language_level": "3"},
    )
)
