"""Models and what runs them fast on this machine: loading pairs (presets, the offline GGUF), the
lean Llama forward, the EAGLE head, the kernels measured here, the cache folder. Imports no other layer.
"""
