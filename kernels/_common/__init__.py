"""What the op folders share: the op registry, launch configurations, the native (C) build, Triton math, threads."""
