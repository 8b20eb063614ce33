from kvik.platforms.base import Platform
from kvik.platforms.selection import PlatformError, select_platform

__all__ = ["Platform", "PlatformError", "select_platform"]
