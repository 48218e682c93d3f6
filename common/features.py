"""The optional features of the service and the Python packages each needs, checked once when a
process starts (by importing them: a package present but missing one of its own dependencies,
say xgrammar without pydantic, counts as missing). A feature that is unavailable is refused with
UNIMPLEMENTED naming the package, and GetModelInfo lists which features are available.

Only the worker needs structured output's packages (it compiles grammars and masks logits); the
scheduler learns the workers' features from Describe.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

STRUCTURED_OUTPUT = "structured_output"
# Feature -> the packages it imports, in the order they are tried.
PACKAGES: dict[str, tuple[str, ...]] = {
    STRUCTURED_OUTPUT: ("pydantic", "xgrammar"),
}


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    available: bool
    detail: str = ""          # when unavailable: why, naming the missing package


def check_feature(name: str) -> Feature:
    """Imports the feature's packages; unavailable (naming the package) if one cannot be imported."""
    for package in PACKAGES[name]:
        try:
            importlib.import_module(package)
        except ImportError as exc:
            missing = getattr(exc, "name", None) or package
            detail = (f"{name.replace('_', ' ')} needs the Python package {missing!r}, which this worker cannot "
                      f"import ({exc})")
            logger.warning("%s is unavailable: %s", name, detail)
            return Feature(name, False, detail)
    return Feature(name, True)


def check_features() -> tuple[Feature, ...]:
    return tuple(check_feature(name) for name in PACKAGES)


def unavailable(features: tuple[Feature, ...], name: str) -> Feature | None:
    """The feature `name` when it is listed as unavailable, else None."""
    return next((f for f in features if f.name == name and not f.available), None)
