"""Quantization: one FP8 representation and every way a load reaches it.

``fp8`` the arithmetic (quantize, dequantize, a LoRA fused exactly); ``layer`` the FP8 linear every quantized load
ends with; ``online`` online quantization of each rank's rows (the row protocol, ``find_layers``); ``checkpoints``
pre-quantized FP8 checkpoints (what is carried, what is refused); ``fuse`` a LoRA fused into FP8 layers;
``parts`` FP8 layers stacked from several checkpoint tensors (vllm-omni's); ``plan`` what quantized layers hold.
"""
