"""The trainer process: a torch FSDP2 worker with torchrun's environment (``python -m
rlorch.trainer.fsdp``) that reads batches from the run directory and publishes weights and
checkpoints into it."""
