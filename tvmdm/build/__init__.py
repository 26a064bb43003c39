"""Compile: options -> fuse -> schedule -> relax.build, shared by inference and training."""
