"""The package list, which pyproject.toml cannot compute: everything under dflash_onnx/, plus the card's top-level
passes/ and targets/ folders as dflash_onnx.passes and dflash_onnx.targets (the mapping is in pyproject.toml), plus
optimum's plugin namespace. Found rather than listed, so a new subpackage cannot be left out of the wheel."""

from setuptools import find_namespace_packages, find_packages, setup

MAPPED = ("passes", "targets")

packages = find_packages(include=["dflash_onnx", "dflash_onnx.*"])
packages += [f"dflash_onnx.{name}" for name in find_packages(include=[f"{top}{tail}" for top in MAPPED
                                                                    for tail in ("", ".*")])]
packages += find_namespace_packages(include=["optimum.commands.register"])

setup(packages=packages)
