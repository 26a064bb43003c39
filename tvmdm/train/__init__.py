"""Training: the training graph (loss, gradients, AdamW, dropout, checkpoints) and the compiled step."""
