"""Model definitions: the embedded BERTs built as ONNX with seeded weights (``bert``), HF transformers exports
(``hf_export``, dev extra) and their PyTorch twins (``torch_reference``, dev extra)."""
from tvmdm.models.bert import (DEFAULT_MODELS, OPSET, BertConfig, build_bert, build_encoder_layer, default_dims,
                               default_model, is_whole_model)

__all__ = ["DEFAULT_MODELS", "OPSET", "BertConfig", "build_bert", "build_encoder_layer", "default_dims",
           "default_model", "is_whole_model"]
