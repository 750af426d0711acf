"""Training-time runtime pieces: optimisers and their helpers."""
