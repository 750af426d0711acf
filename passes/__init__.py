"""Graph passes, one per file (installed as k3compile.passes)."""
