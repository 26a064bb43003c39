"""ONNX -> Relax import for tvmdm: checked loading, TVM 0.27 frontend fixes, symbolic (batch, seq) dims."""
from onnx_import.importer import ImportedModel, import_onnx, import_relax
from onnx_import.loader import load_model_proto

__all__ = ["ImportedModel", "import_onnx", "import_relax", "load_model_proto"]
