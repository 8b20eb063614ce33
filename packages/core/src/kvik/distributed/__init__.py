"""Ranks and their process groups (torch.distributed: NCCL on GPUs, gloo on CPUs)."""
