"""Known start-up noise of third-party libraries, dropped at its source so that a command
prints orbitrl's own output only.

torchao logs a warning for each optional compiled extension (CUDA/cutlass kernels) it cannot
load, which is every one of them on a CPU build, and registering its enums trips a torch
deprecation notice (``register_constant() on Enum subclasses``). Neither concerns a user: the
kernels are not used on CPU and the deprecation is torchao's to fix. Each filter matches one
message on the logger that emits it; every other record, and every ``warnings`` warning,
passes. torchao is imported by our quantized formats, by the memory probe, and by
transformers and peft, so the filters sit on the loggers, not around one import.
"""

from __future__ import annotations

import logging

# logger name -> substrings that together identify the one known message
KNOWN_NOISE = {
    "torchao": ("Failed to load ", ".so"),
    "torch.utils._pytree": ("is an Enum subclass", "register_constant()"),
}


class _DropKnown(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not all(n in msg for n in self.needles)


def install() -> None:
    """Add the filters once per logger (idempotent)."""
    for name, needles in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(needles))
