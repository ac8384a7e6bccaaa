"""ddp-grade: practise PyTorch DistributedDataParallel by hand, graded in real process groups."""

__version__ = "0.1.0"
