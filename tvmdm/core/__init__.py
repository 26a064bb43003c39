"""Stage 0, what every stage shares: errors, tensor specs, targets, precisions, options, the thread count."""
