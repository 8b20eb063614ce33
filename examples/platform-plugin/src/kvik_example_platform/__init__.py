"""An example out-of-tree kvik platform; the tutorial is in ``kvik_example_platform.plugin``."""
