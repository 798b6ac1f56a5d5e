"""What a user runs: the command line, the benchmark, distillation, the lossless sample check, streaming
for notebooks and the app, the first run's choice from this machine's costs, prompt sets. Imports any layer.
"""
