"""The web page's logic for app.py (Gradio): what the page accepts, the handlers behind its buttons, and
how runs and stream updates map to its components. Imports any layer; nothing imports it but app.py.
"""
