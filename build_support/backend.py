"""ragvit's PEP 517 build backend: setuptools', plus the cuBLAS wheel as a build requirement
when the build will compile CUDA and cuBLASLt's header is missing (cuda_find.build_requires),
so that an isolated `pip install .` builds CUDA linear like an in-place build does. A wheel
is built for another environment: it finds libcublasLt through its soname and its RUNPATH,
never through a path of the build's own (setup.py reads RAGVIT_BUILDING_WHEEL)."""

import os

import cuda_find
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 (the hooks this backend does not change)


def get_requires_for_build_wheel(config_settings=None):
    return (_setuptools.get_requires_for_build_wheel(config_settings) +
            cuda_find.build_requires())


def get_requires_for_build_editable(config_settings=None):
    return (_setuptools.get_requires_for_build_editable(config_settings) +
            cuda_find.build_requires())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    os.environ["RAGVIT_BUILDING_WHEEL"] = "1"
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
