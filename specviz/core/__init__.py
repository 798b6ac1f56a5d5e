"""The algorithm and its records: sampling and the acceptance rule, drafters, KV states, the one decode
loop, γ policies, closed-form theory, and the events a run is recorded as. Imports only specviz.models.
"""
