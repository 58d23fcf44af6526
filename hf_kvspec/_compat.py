"""The only module that touches transformers' private names (underscore attributes, internal helpers).

Tested with transformers >=5.24,<6 (pyproject pins the same range). Each helper below names the private
API it wraps; a canary test elsewhere fails loudly if a hook silently stopped running.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

TESTED_RANGE = (Version("5.24"), Version("6"))
TRANSFORMERS_VERSION = Version(transformers.__version__)


def check_transformers_version() -> None:
    """Raise ``RuntimeError`` outside the tested range, naming the install command."""
    low, high = TESTED_RANGE
    if not (low <= Version(TRANSFORMERS_VERSION.base_version) < high):
        raise RuntimeError(
            f"hf_kvspec is tested with transformers >={low},<{high}; found {TRANSFORMERS_VERSION}. "
            f"Install a tested version: pip install 'transformers>={low},<{high}'"
        )
