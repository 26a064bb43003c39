"""Converters for the com.microsoft ops onnxruntime's transformers optimizer writes into a BERT file
(EmbedLayerNormalization, Attention, SkipLayerNormalization), with onnxruntime's semantics, symbolic (batch,
seq) dims and weights kept as graph parameters.

TVM 0.27's converters read every dim as a constant (``.value``: symbolic dims and parameter weights fail),
insist on SkipLayerNormalization's optional bias, and take only 2-D/3-D attention masks where the optimizer
feeds Attention the 1-D token counts of EmbedLayerNormalization. Each op becomes the plain Relax ops the
equivalent ONNX subgraph imports as (add, layer_norm, take, matmul, softmax): the same graph rewrites and
fusions then apply. Installed by ``frontend_fixes.patch_onnx_frontend``.
"""
from __future__ import annotations

import math

DEFAULT_MASK_FILTER = -10000.0  # onnxruntime's Attention: the score bias of a masked key


def _dims(expr) -> list:
    return list(expr.ty.shape.values)


def skip_layer_normalization(base):
    from tvm import relax

    class SkipLayerNormalization(base):
        """input + bias + skip, then LayerNorm(gamma, beta): beta and bias optional. Outputs (output, mean,
        inv_std_var, input_skip_bias_sum): the sum is what the next residual reads in optimized files."""

        @classmethod
        def _impl_v1(cls, bb, inputs, attr, params):
            data, skip, gamma = inputs[0], inputs[1], inputs[2]
            beta = inputs[3] if len(inputs) > 3 else None
            bias = inputs[4] if len(inputs) > 4 else None
            summed = relax.op.add(data, bias) if bias is not None else data
            summed = bb.normalize(relax.op.add(summed, skip))  # the order an exported graph adds them in
            if beta is None:
                beta = relax.op.zeros(_dims(gamma), gamma.ty.dtype)
            output = relax.op.nn.layer_norm(summed, gamma, beta, axes=-1, epsilon=attr.get("epsilon", 1e-12))
            placeholder = relax.const(0, dtype="float32")
            return relax.Tuple([output, placeholder, placeholder, summed])

    return SkipLayerNormalization


def embed_layer_normalization(base):
    from tvm import relax

    class EmbedLayerNormalization(base):
        """LayerNorm(word[ids] + position[pos] + segment[types]); outputs (output, mask_index: the number of
        tokens of each sequence as int32, embedding_sum)."""

        @classmethod
        def _impl_v1(cls, bb, inputs, attr, params):
            ids, segments, word, position, segment, gamma, beta = inputs[:7]
            mask = inputs[7] if len(inputs) > 7 else None
            positions = inputs[8] if len(inputs) > 8 else None
            if positions is None:  # 0..seq-1 for every sequence, seq symbolic or not
                positions = relax.op.arange(0, _dims(ids)[1], 1, dtype="int64")
            summed = relax.op.add(relax.op.take(word, ids, axis=0), relax.op.take(position, positions, axis=0))
            if segments is not None:
                summed = relax.op.add(summed, relax.op.take(segment, segments, axis=0))
            summed = bb.normalize(summed)
            output = relax.op.nn.layer_norm(summed, gamma, beta, axes=-1, epsilon=attr.get("epsilon", 1e-12))
            if mask is not None:
                counts = relax.op.astype(relax.op.sum(relax.op.astype(mask, "int32"), axis=[1]), "int32")
            else:
                counts = relax.op.full((_dims(ids)[0],), relax.const(0, "int32"), "int32")
            return relax.Tuple([output, counts, summed])

    return EmbedLayerNormalization


def _mask_bias(bb, mask, batch, seq, total, filter_value: float, dtype: str):
    """Attention's mask_index as a score bias broadcast to [batch, heads, seq, total]: 1-D, the number of
    leading keys each sequence attends to (EmbedLayerNormalization's output); 2-D [batch, total] or 3-D
    [batch, seq, total], 1 to attend and 0 not to."""
    from tvm import relax

    rank = len(_dims(mask))
    if rank == 1:
        keys = relax.op.arange(0, total, 1, dtype="int32")
        attend = relax.op.less(relax.op.expand_dims(keys, 0), relax.op.expand_dims(relax.op.astype(mask, "int32"), 1))
        attend = relax.op.astype(attend, dtype)
        shape = (batch, 1, 1, total)
    elif rank in (2, 3):
        attend = relax.op.astype(mask, dtype)
        shape = (batch, 1, 1, total) if rank == 2 else (batch, 1, seq, total)
    else:
        raise ValueError(f"mask_index of rank {rank} is not supported (1-D token counts, 2-D or 3-D 0/1 masks)")
    bias = relax.op.multiply(relax.op.subtract(relax.const(1, dtype), attend), relax.const(filter_value, dtype))
    return bb.normalize(relax.op.reshape(bias, shape))


def attention(base):
    from tvm import relax

    class Attention(base):
        """Multi-head self-attention from one packed QKV weight [hidden, 3 hidden] and bias; mask_index as
        onnxruntime reads it; softmax(Q K^T * scale + mask) V, scale 1/sqrt(head size) unless given."""

        @classmethod
        def _impl_v1(cls, bb, inputs, attr, params):
            unsupported = [k for k in ("do_rotary", "past_present_share_buffer", "unidirectional") if attr.get(k)]
            if unsupported or (len(inputs) > 4 and inputs[4] is not None) or (len(inputs) > 6 and inputs[6] is not None):
                raise ValueError(f"Attention with {unsupported or 'a past key/value state'} is not supported")
            x, weight = inputs[0], inputs[1]
            bias = inputs[2] if len(inputs) > 2 else None
            mask = inputs[3] if len(inputs) > 3 else None
            extra = inputs[5] if len(inputs) > 5 else None  # attention_bias [batch, heads, seq, total]
            heads = int(attr["num_heads"])
            batch, seq, _ = _dims(x)
            sizes = attr.get("qkv_hidden_sizes")
            hidden = int(sizes[0]) if sizes else int(_dims(weight)[1]) // 3
            hidden_v = int(sizes[2]) if sizes else hidden
            dtype = x.ty.dtype
            qkv = relax.op.matmul(x, weight)
            if bias is not None:
                qkv = relax.op.add(qkv, bias)
            qkv = bb.normalize(qkv)
            q, k, v = (bb.emit(relax.TupleGetItem(relax.op.split(qkv, [hidden, 2 * hidden], axis=2), i))
                       for i in range(3))

            def heads_first(t, size):  # [B, S, heads * size] -> [B, heads, S, size]
                return relax.op.permute_dims(relax.op.reshape(t, (batch, seq, heads, size)), [0, 2, 1, 3])

            head = hidden // heads
            scale = float(attr.get("scale", 0.0)) or 1.0 / math.sqrt(head)
            scores = relax.op.multiply(relax.op.matmul(heads_first(q, head),
                                                       relax.op.permute_dims(heads_first(k, head), [0, 1, 3, 2])),
                                       relax.const(scale, dtype))
            if mask is not None:
                scores = relax.op.add(scores, _mask_bias(bb, mask, batch, seq, seq,
                                                         float(attr.get("mask_filter_value", DEFAULT_MASK_FILTER)),
                                                         dtype))
            if extra is not None:
                scores = relax.op.add(scores, extra)
            context = relax.op.matmul(relax.op.nn.softmax(scores, axis=-1), heads_first(v, hidden_v // heads))
            output = relax.op.reshape(relax.op.permute_dims(context, [0, 2, 1, 3]), (batch, seq, hidden_v))
            return relax.Tuple([bb.normalize(output), relax.const(0, dtype="float32")])

    return Attention
