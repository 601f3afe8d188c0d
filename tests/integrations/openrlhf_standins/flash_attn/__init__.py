"""The names OpenRLHF 0.11 imports from flash-attn at module level (see ../README.md)."""
