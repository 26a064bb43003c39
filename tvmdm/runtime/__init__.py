"""Running compiled models: input checks, the Relax VM, artifacts on disk. Needs TVM's runtime alone."""
