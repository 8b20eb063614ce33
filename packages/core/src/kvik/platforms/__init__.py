from kvik.platforms.base import Platform
from kvik.platforms.selection import PlatformError, current_platform, select_platform

__all__ = ["Platform", "PlatformError", "current_platform", "select_platform"]
