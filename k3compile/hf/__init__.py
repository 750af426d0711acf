"""Hugging Face checkpoints in and out: Kimi Linear's published config and tensor layout (docs/hf.md).

`config` maps config.json to spec fields and back, `layout` pairs k3compile tensors with checkpoint
tensors, `convert` imports (streaming, shard by shard) and `export` writes a transformers folder.
Only safetensors and JSON are read; transformers itself is never imported.
"""
