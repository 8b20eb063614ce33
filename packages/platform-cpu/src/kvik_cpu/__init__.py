"""kvik's CPU platform: PyTorch (2.8 and newer) on any CPU."""
