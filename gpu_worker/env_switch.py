"""On/off environment switches of the worker (``LOOM_HUGE_PAGES``, ``LOOM_LORA_GEMM``): on unless set to ``0``,
``false``, ``off`` or ``no``; a value that is neither on nor off is logged once as a warning and leaves it on."""

from __future__ import annotations

import logging
import os
from functools import cache

log = logging.getLogger(__name__)

OFF = ("0", "false", "off", "no")
ON = ("", "1", "true", "on", "yes")


def switch_on(name: str) -> bool:
    """Whether the switch ``name`` is on (the default when unset); see the module doc."""
    value = os.environ.get(name, "1").strip().lower()
    if value not in OFF + ON:
        _warn_unknown(name, value)
    return value not in OFF


@cache
def _warn_unknown(name: str, value: str) -> None:
    log.warning("%s=%r is neither 0/false/off/no nor 1/true/on/yes: it stays on", name, value)
