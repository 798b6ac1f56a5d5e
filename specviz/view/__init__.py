"""What a person sees, as pure functions of records: HTML token streams and stats, Plotly charts, the
step-mode stages, notebook display. Reads specviz.core's records; never runs a model.
"""
