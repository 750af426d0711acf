"""Back ends: the importable package a build writes, its manifest, ONNX export."""
