"""Package layout: four source folders install under one ``quantkit`` namespace.

``quantizers/``, ``observers/`` and ``kernels/`` (and the bundled ``calibration_data/``) sit beside
``quantkit/`` in the repository (the product card's layout) and install as ``quantkit.quantizers``,
``quantkit.observers``, ... Every subpackage below each root is found automatically, so a new folder
with an ``__init__.py`` ships in the wheel without editing a list. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

# installed name -> folder in the repository
ROOTS = {
    "quantkit": "quantkit",
    "quantkit.quantizers": "quantizers",
    "quantkit.observers": "observers",
    "quantkit.kernels": "kernels",
    "quantkit.calibration_data": "calibration_data",
}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages.extend(f"{name}.{sub}" for sub in find_packages(folder))

setup(packages=packages, package_dir=dict(ROOTS))
