"""Where each replica's cached prefix blocks most likely live."""

from router.index.base import PrefixIndex
from router.index.memory import MemoryIndex

__all__ = ["MemoryIndex", "PrefixIndex"]
