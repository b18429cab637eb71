"""Builds the one compiled module (the memory index's chain walk); everything else is in pyproject.toml.

The extension is optional: where it cannot be built, kvroute runs the same walk in Python
(``kvroute.indexer.memory.WALK``) and says so at start-up.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("kvroute.indexer._walk", ["indexer/_walk.pyx"], optional=True)],
        compiler_directives={"language_level": "3"},
    )
)
