"""Nothing in it but this docstring."""
# expect-status: unusable
# expect-problem: does not define setup_ddp, cleanup_ddp
