"""Benchmarks: tvmdm side by side with onnxruntime and PyTorch (inference, training, whole BERT, GPU runs)."""
