"""Packages and recipe modules found, not listed: every ``squash`` subpackage, the recipes in
recipes/ as top-level modules, and the configs and kernel sources as ``squash._configs`` and
``squash._kernels`` (mapped from configs/ and kernels/ in pyproject.toml's package-dir).
Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

setup(
    packages=find_packages(include=["squash", "squash.*"]) + ["squash._configs", "squash._kernels"],
    py_modules=sorted(p.stem for p in (HERE / "recipes").glob("*.py")),
)
